import triton_python_backend_utils as pb_utils

TENSORS = {"input": ("INPUT0", "INPUT1"), "output": ("OUTPUT0", "OUTPUT1")}


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        """Fill in the tensors a partial configuration leaves out (a load with an override config)."""
        given = config.as_dict()
        for kind, names in TENSORS.items():
            present = {tensor["name"] for tensor in given.get(kind, [])}
            add = config.add_input if kind == "input" else config.add_output
            for name in names:
                if name not in present:
                    add({"name": name, "data_type": "TYPE_INT32", "dims": [16]})
        return config

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]
                )
            )
        return responses
