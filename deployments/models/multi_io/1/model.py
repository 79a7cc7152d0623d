import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            image = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            ints = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            batch = image.shape[0]
            out0 = image.reshape(batch, 512, 294).sum(axis=-1, dtype="float32")
            out1 = ints.reshape(batch, 5, 2).sum(axis=-1, dtype="int32")
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT0", out0), pb_utils.Tensor("OUTPUT1", out1)]
                )
            )
        return responses
