import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            blocks = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if blocks.ndim != 3 or blocks.shape[1:] != (2, 2):
                raise pb_utils.TritonModelException(f"expected [batch, 2, 2], got {list(blocks.shape)}")
            out = np.ascontiguousarray(np.swapaxes(blocks, 1, 2))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]))
        return responses
