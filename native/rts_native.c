/*
 * rts_native: a Triton backend in C that reads its inputs where the server
 * hands them over and writes its outputs into the buffers the server gives it.
 *
 * Through system shared memory, TRITONBACKEND_InputBuffer returns the server's
 * own mapping of the client's input region and TRITONBACKEND_OutputBuffer its
 * mapping of the client's output region, so the only copy in a request is the
 * one the model itself makes. Models choose what the backend computes with the
 * config parameter "op":
 *
 *   identity  OUTPUT0 = INPUT0 (FP32, any shape): one memcpy.
 *   multi_io  OUTPUT0[b, j] = sum of INPUT0[b] viewed as (512, 294) row j (FP32),
 *             OUTPUT1[b, k] = INPUT1[b, 2k] + INPUT1[b, 2k + 1] (INT32): the
 *             Python example model `multi_io`, in C.
 *   probe     identity, plus ADDRESSES (UINT64 [4]): the addresses and byte sizes
 *             of the input buffer the server handed over and of the output buffer
 *             it gave back, so a test can find them in the server's memory maps.
 *
 * Every failure (missing input, wrong dtype, sizes that do not match the shape,
 * memory that is not CPU) is answered as a Triton error on that request; the
 * backend never aborts the server.
 *
 * The Triton backend C API (version 1.19) is declared below by hand, only the
 * parts used here; the tritonserver binary resolves these symbols when it loads
 * the library, so it is built with no -l flags:
 *     gcc -O2 -fPIC -shared -o libtriton_rts_native.so rts_native.c
 */
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- Triton server / backend API, declared from its documentation ---- */
typedef struct TRITONSERVER_Error TRITONSERVER_Error;
typedef struct TRITONSERVER_Message TRITONSERVER_Message;
typedef struct TRITONBACKEND_Backend TRITONBACKEND_Backend;
typedef struct TRITONBACKEND_Model TRITONBACKEND_Model;
typedef struct TRITONBACKEND_ModelInstance TRITONBACKEND_ModelInstance;
typedef struct TRITONBACKEND_Request TRITONBACKEND_Request;
typedef struct TRITONBACKEND_Response TRITONBACKEND_Response;
typedef struct TRITONBACKEND_Input TRITONBACKEND_Input;
typedef struct TRITONBACKEND_Output TRITONBACKEND_Output;

typedef enum {
  RTS_ERROR_UNKNOWN = 0,
  RTS_ERROR_INTERNAL = 1,
  RTS_ERROR_NOT_FOUND = 2,
  RTS_ERROR_INVALID_ARG = 3,
  RTS_ERROR_UNAVAILABLE = 4,
  RTS_ERROR_UNSUPPORTED = 5,
} rts_error_code;

typedef enum {
  RTS_TYPE_UINT64 = 5,
  RTS_TYPE_INT32 = 8,
  RTS_TYPE_FP32 = 11,
} rts_datatype;

typedef enum { RTS_MEMORY_CPU = 0, RTS_MEMORY_CPU_PINNED = 1, RTS_MEMORY_GPU = 2 } rts_memory_type;

#define RTS_RESPONSE_FINAL 1u
#define RTS_REQUEST_RELEASE_ALL 1u
#define RTS_API_MAJOR 1u
#define RTS_API_MINOR 19u

extern TRITONSERVER_Error* TRITONSERVER_ErrorNew(int code, const char* msg);
extern void TRITONSERVER_ErrorDelete(TRITONSERVER_Error* error);
extern const char* TRITONSERVER_ErrorMessage(TRITONSERVER_Error* error);
extern int TRITONSERVER_ErrorCode(TRITONSERVER_Error* error);
extern TRITONSERVER_Error* TRITONSERVER_MessageSerializeToJson(
    TRITONSERVER_Message* message, const char** base, size_t* byte_size);
extern TRITONSERVER_Error* TRITONSERVER_MessageDelete(TRITONSERVER_Message* message);

extern TRITONSERVER_Error* TRITONBACKEND_ApiVersion(uint32_t* major, uint32_t* minor);
extern TRITONSERVER_Error* TRITONBACKEND_ModelName(TRITONBACKEND_Model* model, const char** name);
extern TRITONSERVER_Error* TRITONBACKEND_ModelConfig(
    TRITONBACKEND_Model* model, uint32_t config_version, TRITONSERVER_Message** model_config);
extern TRITONSERVER_Error* TRITONBACKEND_ModelSetState(TRITONBACKEND_Model* model, void* state);
extern TRITONSERVER_Error* TRITONBACKEND_ModelState(TRITONBACKEND_Model* model, void** state);
extern TRITONSERVER_Error* TRITONBACKEND_ModelInstanceModel(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Model** model);
extern TRITONSERVER_Error* TRITONBACKEND_RequestInput(
    TRITONBACKEND_Request* request, const char* name, TRITONBACKEND_Input** input);
extern TRITONSERVER_Error* TRITONBACKEND_InputProperties(
    TRITONBACKEND_Input* input, const char** name, int* datatype, const int64_t** shape,
    uint32_t* dims_count, uint64_t* byte_size, uint32_t* buffer_count);
extern TRITONSERVER_Error* TRITONBACKEND_InputBuffer(
    TRITONBACKEND_Input* input, uint32_t index, const void** buffer, uint64_t* buffer_byte_size,
    int* memory_type, int64_t* memory_type_id);
extern TRITONSERVER_Error* TRITONBACKEND_ResponseNew(
    TRITONBACKEND_Response** response, TRITONBACKEND_Request* request);
extern TRITONSERVER_Error* TRITONBACKEND_ResponseDelete(TRITONBACKEND_Response* response);
extern TRITONSERVER_Error* TRITONBACKEND_ResponseOutput(
    TRITONBACKEND_Response* response, TRITONBACKEND_Output** output, const char* name,
    int datatype, const int64_t* shape, uint32_t dims_count);
extern TRITONSERVER_Error* TRITONBACKEND_OutputBuffer(
    TRITONBACKEND_Output* output, void** buffer, uint64_t buffer_byte_size, int* memory_type,
    int64_t* memory_type_id);
extern TRITONSERVER_Error* TRITONBACKEND_ResponseSend(
    TRITONBACKEND_Response* response, uint32_t send_flags, TRITONSERVER_Error* error);
extern TRITONSERVER_Error* TRITONBACKEND_RequestRelease(
    TRITONBACKEND_Request* request, uint32_t release_flags);
extern TRITONSERVER_Error* TRITONBACKEND_ModelInstanceReportStatistics(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request* request, bool success,
    uint64_t exec_start_ns, uint64_t compute_start_ns, uint64_t compute_end_ns,
    uint64_t exec_end_ns);
extern TRITONSERVER_Error* TRITONBACKEND_ModelInstanceReportBatchStatistics(
    TRITONBACKEND_ModelInstance* instance, uint64_t batch_size, uint64_t exec_start_ns,
    uint64_t compute_start_ns, uint64_t compute_end_ns, uint64_t exec_end_ns);

#define RTS_EXPORT __attribute__((visibility("default")))

/* ---- helpers ---- */
typedef enum { OP_IDENTITY = 1, OP_MULTI_IO = 2, OP_PROBE = 3 } rts_op;

typedef struct {
  rts_op op;
  char name[128];
} rts_model;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts); /* std::chrono::steady_clock, as Triton's own stamps */
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static TRITONSERVER_Error* errorf(int code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

static TRITONSERVER_Error* errorf(int code, const char* fmt, ...) {
  char msg[512];
  va_list args;
  va_start(args, fmt);
  vsnprintf(msg, sizeof msg, fmt, args);
  va_end(args);
  return TRITONSERVER_ErrorNew(code, msg);
}

#define RETURN_IF_ERROR(expr)              \
  do {                                     \
    TRITONSERVER_Error* rts_err__ = (expr); \
    if (rts_err__ != NULL) return rts_err__; \
  } while (0)

static const char* dtype_name(int dtype) {
  static const char* names[] = {"INVALID", "BOOL", "UINT8", "UINT16", "UINT32", "UINT64",
                                "INT8",    "INT16", "INT32", "INT64",  "FP16",   "FP32",
                                "FP64",    "BYTES", "BF16"};
  return (dtype >= 0 && dtype < (int)(sizeof names / sizeof names[0])) ? names[dtype] : "UNKNOWN";
}

/* One input of a request: its shape, and its bytes in one piece. */
typedef struct {
  const int64_t* shape;
  uint32_t dims;
  uint64_t byte_size;
  const char* data; /* the server's buffer itself when it comes in one piece */
  void* gathered;   /* owned copy when the server hands it over in several pieces */
} rts_input;

static void input_free(rts_input* in) {
  free(in->gathered);
  in->gathered = NULL;
}

static TRITONSERVER_Error* input_get(
    TRITONBACKEND_Request* request, const char* name, int dtype, uint32_t elem_size, rts_input* in) {
  TRITONBACKEND_Input* input = NULL;
  TRITONSERVER_Error* err = TRITONBACKEND_RequestInput(request, name, &input);
  if (err != NULL) {
    TRITONSERVER_Error* wrapped = errorf(
        RTS_ERROR_INVALID_ARG, "input '%s' is missing: %s", name, TRITONSERVER_ErrorMessage(err));
    TRITONSERVER_ErrorDelete(err);
    return wrapped;
  }
  int got_dtype = 0;
  uint32_t buffers = 0;
  RETURN_IF_ERROR(TRITONBACKEND_InputProperties(
      input, NULL, &got_dtype, &in->shape, &in->dims, &in->byte_size, &buffers));
  if (got_dtype != dtype) {
    return errorf(RTS_ERROR_INVALID_ARG, "input '%s' has datatype %s, expected %s", name,
                  dtype_name(got_dtype), dtype_name(dtype));
  }
  uint64_t elements = 1;
  for (uint32_t d = 0; d < in->dims; ++d) {
    if (in->shape[d] < 0) return errorf(RTS_ERROR_INVALID_ARG, "input '%s' has a negative dim", name);
    elements *= (uint64_t)in->shape[d];
  }
  if (elements * elem_size != in->byte_size) {
    return errorf(RTS_ERROR_INVALID_ARG,
                  "input '%s' holds %llu bytes but its shape needs %llu", name,
                  (unsigned long long)in->byte_size, (unsigned long long)(elements * elem_size));
  }
  in->data = NULL;
  in->gathered = NULL;
  uint64_t filled = 0;
  for (uint32_t b = 0; b < buffers; ++b) {
    const void* piece = NULL;
    uint64_t piece_size = 0;
    int memory_type = RTS_MEMORY_CPU;
    int64_t memory_type_id = 0;
    err = TRITONBACKEND_InputBuffer(input, b, &piece, &piece_size, &memory_type, &memory_type_id);
    if (err != NULL) {
      input_free(in);
      return err;
    }
    if (memory_type == RTS_MEMORY_GPU) {
      input_free(in);
      return errorf(RTS_ERROR_UNSUPPORTED, "input '%s' is in GPU memory; rts_native reads CPU memory only", name);
    }
    if (filled + piece_size > in->byte_size) {
      input_free(in);
      return errorf(RTS_ERROR_INVALID_ARG, "input '%s' buffers hold more than its %llu bytes", name,
                    (unsigned long long)in->byte_size);
    }
    if (buffers == 1) {
      in->data = (const char*)piece;
    } else {
      if (in->gathered == NULL) {
        in->gathered = malloc(in->byte_size ? in->byte_size : 1);
        if (in->gathered == NULL) return errorf(RTS_ERROR_INTERNAL, "out of memory gathering '%s'", name);
        in->data = (const char*)in->gathered;
      }
      memcpy((char*)in->gathered + filled, piece, piece_size);
    }
    filled += piece_size;
  }
  if (filled != in->byte_size) {
    input_free(in);
    return errorf(RTS_ERROR_INVALID_ARG, "input '%s' buffers hold %llu of its %llu bytes", name,
                  (unsigned long long)filled, (unsigned long long)in->byte_size);
  }
  if (in->data == NULL) in->data = ""; /* zero bytes: a valid, empty tensor */
  return NULL;
}

static TRITONSERVER_Error* output_get(
    TRITONBACKEND_Response* response, const char* name, int dtype, const int64_t* shape,
    uint32_t dims, uint64_t byte_size, char** buffer) {
  TRITONBACKEND_Output* output = NULL;
  RETURN_IF_ERROR(TRITONBACKEND_ResponseOutput(response, &output, name, dtype, shape, dims));
  void* out = NULL;
  int memory_type = RTS_MEMORY_CPU;
  int64_t memory_type_id = 0;
  RETURN_IF_ERROR(TRITONBACKEND_OutputBuffer(output, &out, byte_size, &memory_type, &memory_type_id));
  if (memory_type == RTS_MEMORY_GPU) {
    return errorf(RTS_ERROR_UNSUPPORTED, "output '%s' was given GPU memory; rts_native writes CPU memory only", name);
  }
  if (out == NULL && byte_size > 0) return errorf(RTS_ERROR_INTERNAL, "no buffer for output '%s'", name);
  *buffer = (char*)out;
  return NULL;
}

/* ---- the ops ---- */
static TRITONSERVER_Error* run_identity(
    TRITONBACKEND_Request* request, TRITONBACKEND_Response* response, bool probe,
    uint64_t* compute_start, uint64_t* compute_end) {
  rts_input in;
  RETURN_IF_ERROR(input_get(request, "INPUT0", RTS_TYPE_FP32, 4, &in));
  char* out = NULL;
  TRITONSERVER_Error* err =
      output_get(response, "OUTPUT0", RTS_TYPE_FP32, in.shape, in.dims, in.byte_size, &out);
  if (err == NULL) {
    *compute_start = now_ns();
    if (in.byte_size > 0) memcpy(out, in.data, in.byte_size);
    *compute_end = now_ns();
  }
  if (err == NULL && probe) {
    const int64_t shape[1] = {4};
    char* addresses = NULL;
    err = output_get(response, "ADDRESSES", RTS_TYPE_UINT64, shape, 1, 4 * sizeof(uint64_t), &addresses);
    if (err == NULL) {
      /* gathered == NULL: the address is the server's buffer itself, never a copy of ours */
      const uint64_t report[4] = {
          in.gathered ? 0 : (uint64_t)(uintptr_t)in.data, in.byte_size,
          (uint64_t)(uintptr_t)out, in.byte_size};
      memcpy(addresses, report, sizeof report);
    }
  }
  input_free(&in);
  return err;
}

#define MULTI_IO_ROWS 512
#define MULTI_IO_COLS 294
#define MULTI_IO_PAIRS 5

static TRITONSERVER_Error* run_multi_io(
    TRITONBACKEND_Request* request, TRITONBACKEND_Response* response, uint64_t* compute_start,
    uint64_t* compute_end) {
  rts_input image, ints;
  RETURN_IF_ERROR(input_get(request, "INPUT0", RTS_TYPE_FP32, 4, &image));
  TRITONSERVER_Error* err = input_get(request, "INPUT1", RTS_TYPE_INT32, 4, &ints);
  if (err != NULL) {
    input_free(&image);
    return err;
  }
  const uint64_t image_items = MULTI_IO_ROWS * MULTI_IO_COLS;
  const uint64_t batch = image.dims > 0 ? (uint64_t)image.shape[0] : 0;
  if (image.dims != 4 || image.byte_size != batch * image_items * 4) {
    err = errorf(RTS_ERROR_INVALID_ARG, "INPUT0 must be [batch, 3, 224, 224] FP32");
  } else if (ints.dims != 2 || ints.shape[0] != (int64_t)batch || ints.shape[1] != 2 * MULTI_IO_PAIRS) {
    err = errorf(RTS_ERROR_INVALID_ARG, "INPUT1 must be [%llu, 10] INT32", (unsigned long long)batch);
  }
  char* out0 = NULL;
  char* out1 = NULL;
  if (err == NULL) {
    const int64_t shape0[2] = {(int64_t)batch, MULTI_IO_ROWS};
    err = output_get(response, "OUTPUT0", RTS_TYPE_FP32, shape0, 2, batch * MULTI_IO_ROWS * 4, &out0);
  }
  if (err == NULL) {
    const int64_t shape1[2] = {(int64_t)batch, MULTI_IO_PAIRS};
    err = output_get(response, "OUTPUT1", RTS_TYPE_INT32, shape1, 2, batch * MULTI_IO_PAIRS * 4, &out1);
  }
  if (err == NULL) {
    *compute_start = now_ns();
    for (uint64_t b = 0; b < batch; ++b) {
      const float* rows = (const float*)image.data + b * image_items;
      float* sums = (float*)out0 + b * MULTI_IO_ROWS;
      for (uint64_t j = 0; j < MULTI_IO_ROWS; ++j) {
        double sum = 0.0; /* wider than numpy's pairwise float32 sum: agrees to float rounding */
        const float* row = rows + j * MULTI_IO_COLS;
        for (uint64_t c = 0; c < MULTI_IO_COLS; ++c) sum += row[c];
        sums[j] = (float)sum;
      }
      const int32_t* pairs = (const int32_t*)ints.data + b * 2 * MULTI_IO_PAIRS;
      int32_t* pair_sums = (int32_t*)out1 + b * MULTI_IO_PAIRS;
      for (uint64_t k = 0; k < MULTI_IO_PAIRS; ++k) {
        /* int32 wraps like numpy's int32 sum; unsigned arithmetic keeps C well-defined */
        pair_sums[k] = (int32_t)((uint32_t)pairs[2 * k] + (uint32_t)pairs[2 * k + 1]);
      }
    }
    *compute_end = now_ns();
  }
  input_free(&image);
  input_free(&ints);
  return err;
}

/* ---- the backend's entry points ---- */
RTS_EXPORT TRITONSERVER_Error* TRITONBACKEND_Initialize(TRITONBACKEND_Backend* backend) {
  (void)backend;
  uint32_t major = 0, minor = 0;
  RETURN_IF_ERROR(TRITONBACKEND_ApiVersion(&major, &minor));
  if (major != RTS_API_MAJOR || minor < RTS_API_MINOR) {
    return errorf(RTS_ERROR_UNSUPPORTED,
                  "rts_native needs Triton backend API %u.%u or a later 1.x; this server has %u.%u",
                  RTS_API_MAJOR, RTS_API_MINOR, major, minor);
  }
  return NULL;
}

/* The op named by the config parameter "op", from the config as JSON. */
static rts_op parse_op(const char* json, size_t size, char* found, size_t found_size) {
  static const char key[] = "\"op\":{\"string_value\":\"";
  found[0] = '\0';
  const char* end = json + size;
  for (const char* at = json; at + sizeof key - 1 <= end; ++at) {
    if (memcmp(at, key, sizeof key - 1) != 0) continue;
    const char* value = at + sizeof key - 1;
    size_t n = 0;
    while (value + n < end && value[n] != '"' && n + 1 < found_size) ++n;
    memcpy(found, value, n);
    found[n] = '\0';
    break;
  }
  if (strcmp(found, "identity") == 0) return OP_IDENTITY;
  if (strcmp(found, "multi_io") == 0) return OP_MULTI_IO;
  if (strcmp(found, "probe") == 0) return OP_PROBE;
  return 0;
}

RTS_EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInitialize(TRITONBACKEND_Model* model) {
  const char* name = NULL;
  RETURN_IF_ERROR(TRITONBACKEND_ModelName(model, &name));
  TRITONSERVER_Message* config = NULL;
  RETURN_IF_ERROR(TRITONBACKEND_ModelConfig(model, 1, &config));
  const char* json = NULL;
  size_t json_size = 0;
  TRITONSERVER_Error* err = TRITONSERVER_MessageSerializeToJson(config, &json, &json_size);
  char op_name[64];
  rts_op op = 0;
  if (err == NULL) op = parse_op(json, json_size, op_name, sizeof op_name);
  TRITONSERVER_Error* del = TRITONSERVER_MessageDelete(config);
  if (del != NULL) TRITONSERVER_ErrorDelete(del);
  if (err != NULL) return err;
  if (op == 0) {
    return errorf(RTS_ERROR_INVALID_ARG,
                  "model '%s': parameter \"op\" is '%s'; rts_native knows identity, multi_io, probe",
                  name, op_name);
  }
  rts_model* state = calloc(1, sizeof *state);
  if (state == NULL) return errorf(RTS_ERROR_INTERNAL, "out of memory");
  state->op = op;
  snprintf(state->name, sizeof state->name, "%s", name);
  err = TRITONBACKEND_ModelSetState(model, state);
  if (err != NULL) free(state);
  return err;
}

RTS_EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelFinalize(TRITONBACKEND_Model* model) {
  void* state = NULL;
  RETURN_IF_ERROR(TRITONBACKEND_ModelState(model, &state));
  free(state);
  return NULL;
}

static void drop(TRITONSERVER_Error* err) {
  if (err != NULL) TRITONSERVER_ErrorDelete(err);
}

RTS_EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests, const uint32_t request_count) {
  TRITONBACKEND_Model* model = NULL;
  RETURN_IF_ERROR(TRITONBACKEND_ModelInstanceModel(instance, &model));
  void* state = NULL;
  RETURN_IF_ERROR(TRITONBACKEND_ModelState(model, &state));
  const rts_op op = ((rts_model*)state)->op;
  const uint64_t exec_start = now_ns();
  uint64_t batch_compute_start = 0, batch_compute_end = 0;
  for (uint32_t r = 0; r < request_count; ++r) {
    TRITONBACKEND_Request* request = requests[r];
    const uint64_t request_start = now_ns();
    uint64_t compute_start = 0, compute_end = 0;
    TRITONBACKEND_Response* response = NULL;
    TRITONSERVER_Error* err = TRITONBACKEND_ResponseNew(&response, request);
    if (err == NULL) {
      if (op == OP_MULTI_IO) {
        err = run_multi_io(request, response, &compute_start, &compute_end);
      } else {
        err = run_identity(request, response, op == OP_PROBE, &compute_start, &compute_end);
      }
      /* ResponseSend does not take ownership of err: it is ours to delete. */
      drop(TRITONBACKEND_ResponseSend(response, RTS_RESPONSE_FINAL, err));
    }
    const bool ok = err == NULL;
    drop(err);
    if (compute_start == 0) compute_start = compute_end = now_ns();
    if (batch_compute_start == 0) batch_compute_start = compute_start;
    batch_compute_end = compute_end;
    drop(TRITONBACKEND_ModelInstanceReportStatistics(
        instance, request, ok, request_start, compute_start, compute_end, now_ns()));
    drop(TRITONBACKEND_RequestRelease(request, RTS_REQUEST_RELEASE_ALL));
  }
  drop(TRITONBACKEND_ModelInstanceReportBatchStatistics(
      instance, request_count, exec_start, batch_compute_start, batch_compute_end, now_ns()));
  return NULL;
}
