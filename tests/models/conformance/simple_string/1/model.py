import numpy as np
import triton_python_backend_utils as pb_utils


def _numbers(tensor):
    return np.vectorize(lambda item: int(item.decode("utf-8") if isinstance(item, bytes) else item))(
        tensor.as_numpy()
    ).astype(np.int64)


def _strings(values):
    out = np.empty(values.shape, dtype=object)
    out.flat[:] = [str(int(v)).encode("utf-8") for v in values.flat]
    return out


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                a = _numbers(pb_utils.get_input_tensor_by_name(request, "INPUT0"))
                b = _numbers(pb_utils.get_input_tensor_by_name(request, "INPUT1"))
            except (UnicodeDecodeError, ValueError) as e:
                responses.append(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(f"inputs must be integers: {e}"))
                )
                continue
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT0", _strings(a + b)), pb_utils.Tensor("OUTPUT1", _strings(a - b))]
                )
            )
        return responses
