import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            upper = np.array([item.upper() for item in text.flat], dtype=object).reshape(text.shape)
            length = np.array([len(item) for item in text.flat], dtype=np.int32).reshape(text.shape)
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("UPPER", upper), pb_utils.Tensor("LENGTH", length)])
            )
        return responses
