import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(error=pb_utils.TritonError("simple_error fails every request"))
            for _ in requests
        ]
