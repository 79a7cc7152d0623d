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
 *             it gave back, so a test can find them in the server's memory maps;
 *             and MEMORY (UINT64 [4]) where the model declares it: the memory
 *             type and device id of those two buffers (0 CPU, 1 CPU_PINNED, 2 GPU).
 *             Each is written only when the request asks for it.
 *
 * Instances of kind KIND_CPU run every op on the CPU and read CPU memory only.
 * Instances of kind KIND_GPU (ops identity and probe) run on their GPU: they ask
 * Triton for GPU memory on the instance's device, and the tensor always passes
 * through that GPU, with the copies the memory Triton hands over calls for:
 *
 *   input GPU,  output GPU   one device-to-device copy (CUDA shared memory both
 *                            ways: no host copy anywhere)
 *   input host, output GPU   one host-to-device copy
 *   input GPU,  output host  one device-to-host copy
 *   input host, output host  host to the instance's device buffer, then back
 *
 * The CUDA driver library (libcuda.so.1, or the model parameter "cuda_driver")
 * is opened with dlopen by each GPU instance as it is created, so the backend
 * still builds with a C compiler alone and CPU instances never touch CUDA. The
 * driver API and not the runtime: the driver library comes with every NVIDIA
 * driver, whatever CUDA runtime (12, 13, or the one bundled inside Triton under
 * another name) a machine has, and its primary context is the one Triton's own
 * runtime uses, so pointers Triton hands over are valid in it.
 *
 * Every failure (missing input, wrong dtype, sizes that do not match the shape,
 * GPU memory reaching a CPU instance, a CUDA call failing) is answered as a Triton
 * error on that request; a GPU instance whose driver cannot be loaded fails its
 * model's load with a message naming the library. The backend never aborts the
 * server.
 *
 * The Triton backend C API (version 1.19) is declared below by hand, only the
 * parts used here; the tritonserver binary resolves these symbols when it loads
 * the library, so it is built with no -l flags (dlopen comes from the C
 * library, or libdl, that the server has already loaded):
 *     gcc -O2 -fPIC -shared -o libtriton_rts_native.so rts_native.c
 */
#include <dlfcn.h>
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

typedef enum { RTS_KIND_AUTO = 0, RTS_KIND_CPU = 1, RTS_KIND_GPU = 2, RTS_KIND_MODEL = 3 } rts_instance_kind;
typedef enum { RTS_LOG_INFO = 0, RTS_LOG_WARN = 1, RTS_LOG_ERROR = 2, RTS_LOG_VERBOSE = 3 } rts_log_level;

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

extern TRITONSERVER_Error* TRITONSERVER_LogMessage(
    int level, const char* filename, const int line, const char* msg);

extern TRITONSERVER_Error* TRITONBACKEND_ApiVersion(uint32_t* major, uint32_t* minor);
extern TRITONSERVER_Error* TRITONBACKEND_ModelName(TRITONBACKEND_Model* model, const char** name);
extern TRITONSERVER_Error* TRITONBACKEND_ModelConfig(
    TRITONBACKEND_Model* model, uint32_t config_version, TRITONSERVER_Message** model_config);
extern TRITONSERVER_Error* TRITONBACKEND_ModelSetState(TRITONBACKEND_Model* model, void* state);
extern TRITONSERVER_Error* TRITONBACKEND_ModelState(TRITONBACKEND_Model* model, void** state);
extern TRITONSERVER_Error* TRITONBACKEND_ModelInstanceModel(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Model** model);
extern TRITONSERVER_Error* TRITONBACKEND_ModelInstanceName(
    TRITONBACKEND_ModelInstance* instance, const char** name);
extern TRITONSERVER_Error* TRITONBACKEND_ModelInstanceKind(TRITONBACKEND_ModelInstance* instance, int* kind);
extern TRITONSERVER_Error* TRITONBACKEND_ModelInstanceDeviceId(
    TRITONBACKEND_ModelInstance* instance, int32_t* device_id);
extern TRITONSERVER_Error* TRITONBACKEND_ModelInstanceSetState(TRITONBACKEND_ModelInstance* instance, void* state);
extern TRITONSERVER_Error* TRITONBACKEND_ModelInstanceState(TRITONBACKEND_ModelInstance* instance, void** state);
extern TRITONSERVER_Error* TRITONBACKEND_RequestOutputCount(TRITONBACKEND_Request* request, uint32_t* count);
extern TRITONSERVER_Error* TRITONBACKEND_RequestOutputName(
    TRITONBACKEND_Request* request, uint32_t index, const char** name);
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

#define RTS_DEFAULT_CUDA_DRIVER "libcuda.so.1"

typedef struct {
  rts_op op;
  char name[128];
  char cuda_driver[256]; /* the library a GPU instance opens: parameter "cuda_driver" */
} rts_model;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts); /* std::chrono::steady_clock, as Triton's own stamps */
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static TRITONSERVER_Error* errorf(int code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

static TRITONSERVER_Error* errorf(int code, const char* fmt, ...) {
  char msg[1024];
  va_list args;
  va_start(args, fmt);
  vsnprintf(msg, sizeof msg, fmt, args);
  va_end(args);
  return TRITONSERVER_ErrorNew(code, msg);
}

static void drop(TRITONSERVER_Error* err) {
  if (err != NULL) TRITONSERVER_ErrorDelete(err);
}

static void logf_info(int line, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

static void logf_info(int line, const char* fmt, ...) {
  char msg[512];
  va_list args;
  va_start(args, fmt);
  vsnprintf(msg, sizeof msg, fmt, args);
  va_end(args);
  drop(TRITONSERVER_LogMessage(RTS_LOG_INFO, __FILE__, line, msg));
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

/* Whether the request asks for output `name` (Triton lists every output when a client names none). */
static bool output_requested(TRITONBACKEND_Request* request, const char* name) {
  uint32_t count = 0;
  TRITONSERVER_Error* err = TRITONBACKEND_RequestOutputCount(request, &count);
  if (err != NULL) {
    drop(err);
    return false;
  }
  for (uint32_t i = 0; i < count; ++i) {
    const char* requested = NULL;
    err = TRITONBACKEND_RequestOutputName(request, i, &requested);
    if (err != NULL) {
      drop(err);
      continue;
    }
    if (requested != NULL && strcmp(requested, name) == 0) return true;
  }
  return false;
}

/* One input of a request: its shape, and (CPU instances) its bytes in one piece. */
typedef struct {
  TRITONBACKEND_Input* handle;
  const int64_t* shape;
  uint32_t dims;
  uint64_t byte_size;
  uint32_t buffers;
  const char* data;       /* the server's buffer itself when it comes in one piece */
  void* gathered;         /* owned copy when the server hands it over in several pieces */
  int memory_type;        /* of the first piece */
  int64_t memory_type_id; /* of the first piece */
} rts_input;

static void input_free(rts_input* in) {
  free(in->gathered);
  in->gathered = NULL;
}

/* The input's properties, checked against its datatype and shape; no buffer is touched yet. */
static TRITONSERVER_Error* input_properties(
    TRITONBACKEND_Request* request, const char* name, int dtype, uint32_t elem_size, rts_input* in) {
  memset(in, 0, sizeof *in);
  TRITONSERVER_Error* err = TRITONBACKEND_RequestInput(request, name, &in->handle);
  if (err != NULL) {
    TRITONSERVER_Error* wrapped = errorf(
        RTS_ERROR_INVALID_ARG, "input '%s' is missing: %s", name, TRITONSERVER_ErrorMessage(err));
    TRITONSERVER_ErrorDelete(err);
    return wrapped;
  }
  int got_dtype = 0;
  RETURN_IF_ERROR(TRITONBACKEND_InputProperties(
      in->handle, NULL, &got_dtype, &in->shape, &in->dims, &in->byte_size, &in->buffers));
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
  in->memory_type = RTS_MEMORY_CPU;
  return NULL;
}

/* CPU instances: the input's properties and its bytes in CPU memory, in one piece. */
static TRITONSERVER_Error* input_get(
    TRITONBACKEND_Request* request, const char* name, int dtype, uint32_t elem_size, rts_input* in) {
  RETURN_IF_ERROR(input_properties(request, name, dtype, elem_size, in));
  uint64_t filled = 0;
  for (uint32_t b = 0; b < in->buffers; ++b) {
    const void* piece = NULL;
    uint64_t piece_size = 0;
    int memory_type = RTS_MEMORY_CPU;
    int64_t memory_type_id = 0;
    TRITONSERVER_Error* err =
        TRITONBACKEND_InputBuffer(in->handle, b, &piece, &piece_size, &memory_type, &memory_type_id);
    if (err != NULL) {
      input_free(in);
      return err;
    }
    if (b == 0) {
      in->memory_type = memory_type;
      in->memory_type_id = memory_type_id;
    }
    if (memory_type == RTS_MEMORY_GPU) {
      input_free(in);
      return errorf(RTS_ERROR_UNSUPPORTED,
                    "input '%s' is in GPU memory; a KIND_CPU instance of rts_native reads CPU memory only",
                    name);
    }
    if (filled + piece_size > in->byte_size) {
      input_free(in);
      return errorf(RTS_ERROR_INVALID_ARG, "input '%s' buffers hold more than its %llu bytes", name,
                    (unsigned long long)in->byte_size);
    }
    if (in->buffers == 1) {
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

/* One output buffer, asked for in memory of type `*memory_type` on device `*memory_type_id`;
 * both are replaced by what the server gave. */
static TRITONSERVER_Error* output_alloc(
    TRITONBACKEND_Response* response, const char* name, int dtype, const int64_t* shape,
    uint32_t dims, uint64_t byte_size, char** buffer, int* memory_type, int64_t* memory_type_id) {
  TRITONBACKEND_Output* output = NULL;
  RETURN_IF_ERROR(TRITONBACKEND_ResponseOutput(response, &output, name, dtype, shape, dims));
  void* out = NULL;
  RETURN_IF_ERROR(TRITONBACKEND_OutputBuffer(output, &out, byte_size, memory_type, memory_type_id));
  if (out == NULL && byte_size > 0) return errorf(RTS_ERROR_INTERNAL, "no buffer for output '%s'", name);
  *buffer = (char*)out;
  return NULL;
}

/* CPU instances: an output buffer in CPU memory. */
static TRITONSERVER_Error* output_get(
    TRITONBACKEND_Response* response, const char* name, int dtype, const int64_t* shape,
    uint32_t dims, uint64_t byte_size, char** buffer, int* memory_type, int64_t* memory_type_id) {
  int got_type = RTS_MEMORY_CPU;
  int64_t got_id = 0;
  RETURN_IF_ERROR(output_alloc(response, name, dtype, shape, dims, byte_size, buffer, &got_type, &got_id));
  if (got_type == RTS_MEMORY_GPU) {
    return errorf(RTS_ERROR_UNSUPPORTED,
                  "output '%s' was given GPU memory; a KIND_CPU instance of rts_native writes CPU memory only",
                  name);
  }
  if (memory_type != NULL) *memory_type = got_type;
  if (memory_type_id != NULL) *memory_type_id = got_id;
  return NULL;
}

/* ---- the CUDA driver API, opened at run time by GPU instances ----
 * Declared by hand, following the CUDA driver ABI of cuda.h: CUresult is an int
 * (CUDA_SUCCESS 0), CUdevice an int, CUdeviceptr an unsigned 64-bit integer on
 * 64-bit hosts, contexts and streams opaque pointers. The functions with a _v2
 * suffix are the ones cuda.h maps the plain names to since CUDA 4.0. */
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef struct CUstream_st* CUstream;
typedef unsigned long long CUdeviceptr;
#define RTS_CUDA_SUCCESS 0
#define RTS_CU_STREAM_NON_BLOCKING 0x1u

typedef struct {
  CUresult (*init)(unsigned int flags);
  CUresult (*device_get)(CUdevice* device, int ordinal);
  CUresult (*primary_ctx_retain)(CUcontext* context, CUdevice device);
  CUresult (*primary_ctx_release)(CUdevice device);
  CUresult (*ctx_push)(CUcontext context);
  CUresult (*ctx_pop)(CUcontext* context);
  CUresult (*stream_create)(CUstream* stream, unsigned int flags);
  CUresult (*stream_destroy)(CUstream stream);
  CUresult (*stream_synchronize)(CUstream stream);
  CUresult (*mem_alloc)(CUdeviceptr* pointer, size_t bytes);
  CUresult (*mem_free)(CUdeviceptr pointer);
  CUresult (*memcpy_dtod)(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream);
  CUresult (*memcpy_htod)(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream);
  CUresult (*memcpy_dtoh)(void* dst, CUdeviceptr src, size_t bytes, CUstream stream);
  CUresult (*get_error_name)(CUresult result, const char** text);
  CUresult (*get_error_string)(CUresult result, const char** text);
} rts_cuda_api;

/* How a GPU instance moves one buffer, from the memory types Triton handed over. */
typedef enum {
  ROUTE_DTOD = 0,            /* GPU to GPU: one device-to-device copy */
  ROUTE_HTOD = 1,            /* host to GPU: one host-to-device copy */
  ROUTE_DTOH = 2,            /* GPU to host: one device-to-host copy */
  ROUTE_HOST_VIA_DEVICE = 3, /* host to host: onto the instance's GPU and back */
} rts_route;
#define RTS_ROUTES 4

static rts_route copy_route(int src_memory_type, int dst_memory_type) {
  const bool src_gpu = src_memory_type == RTS_MEMORY_GPU;
  const bool dst_gpu = dst_memory_type == RTS_MEMORY_GPU;
  if (src_gpu) return dst_gpu ? ROUTE_DTOD : ROUTE_DTOH;
  return dst_gpu ? ROUTE_HTOD : ROUTE_HOST_VIA_DEVICE;
}

static const char* const route_names[RTS_ROUTES] = {
    "device-to-device", "host-to-device", "device-to-host", "host-via-device"};

/* One model instance. GPU instances own a driver handle, the device's primary context, a stream. */
typedef struct {
  bool gpu;
  int32_t device;
  char name[128];
  void* library;
  rts_cuda_api cu;
  CUdevice cu_device;
  CUcontext context; /* retained primary context: the one Triton's CUDA runtime uses */
  CUstream stream;
  CUdeviceptr scratch; /* host-to-host buffers pass through here */
  size_t scratch_size;
  uint64_t route_bytes[RTS_ROUTES];
  uint64_t route_copies[RTS_ROUTES];
} rts_instance;

static TRITONSERVER_Error* cuda_error(const rts_instance* gi, CUresult result, const char* what) {
  const char* name = NULL;
  const char* text = NULL;
  if (gi->cu.get_error_name == NULL || gi->cu.get_error_name(result, &name) != RTS_CUDA_SUCCESS) name = NULL;
  if (gi->cu.get_error_string == NULL || gi->cu.get_error_string(result, &text) != RTS_CUDA_SUCCESS) text = NULL;
  return errorf(RTS_ERROR_INTERNAL, "rts_native instance '%s' on GPU %d: %s failed: %s (%d): %s", gi->name,
                gi->device, what, name ? name : "CUDA error", result, text ? text : "no description");
}

#define CUDA_RETURN_IF_ERROR(gi, call, what)                             \
  do {                                                                   \
    CUresult rts_cu__ = (call);                                          \
    if (rts_cu__ != RTS_CUDA_SUCCESS) return cuda_error((gi), rts_cu__, (what)); \
  } while (0)

/* Opens the driver library and resolves what a GPU instance calls. */
static TRITONSERVER_Error* cuda_open(rts_instance* gi, const char* model, const char* library) {
  gi->library = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (gi->library == NULL) {
    const char* why = dlerror();
    return errorf(RTS_ERROR_UNAVAILABLE,
                  "model '%s' instance '%s' is KIND_GPU (device %d), and a GPU instance needs a CUDA device: "
                  "cannot load the CUDA driver library '%s' (%s). Install the NVIDIA driver, or use "
                  "instance_group [{kind: KIND_CPU}] to run the model on the CPU",
                  model, gi->name, gi->device, library, why ? why : "not found");
  }
  static const struct {
    const char* symbol;
    size_t offset;
  } symbols[] = {
      {"cuInit", offsetof(rts_cuda_api, init)},
      {"cuDeviceGet", offsetof(rts_cuda_api, device_get)},
      {"cuDevicePrimaryCtxRetain", offsetof(rts_cuda_api, primary_ctx_retain)},
      {"cuDevicePrimaryCtxRelease_v2", offsetof(rts_cuda_api, primary_ctx_release)},
      {"cuCtxPushCurrent_v2", offsetof(rts_cuda_api, ctx_push)},
      {"cuCtxPopCurrent_v2", offsetof(rts_cuda_api, ctx_pop)},
      {"cuStreamCreate", offsetof(rts_cuda_api, stream_create)},
      {"cuStreamDestroy_v2", offsetof(rts_cuda_api, stream_destroy)},
      {"cuStreamSynchronize", offsetof(rts_cuda_api, stream_synchronize)},
      {"cuMemAlloc_v2", offsetof(rts_cuda_api, mem_alloc)},
      {"cuMemFree_v2", offsetof(rts_cuda_api, mem_free)},
      {"cuMemcpyDtoDAsync_v2", offsetof(rts_cuda_api, memcpy_dtod)},
      {"cuMemcpyHtoDAsync_v2", offsetof(rts_cuda_api, memcpy_htod)},
      {"cuMemcpyDtoHAsync_v2", offsetof(rts_cuda_api, memcpy_dtoh)},
      {"cuGetErrorName", offsetof(rts_cuda_api, get_error_name)},
      {"cuGetErrorString", offsetof(rts_cuda_api, get_error_string)},
  };
  for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; ++i) {
    void* fn = dlsym(gi->library, symbols[i].symbol);
    if (fn == NULL) {
      return errorf(RTS_ERROR_UNAVAILABLE,
                    "model '%s' instance '%s': the CUDA driver library '%s' has no %s; it is not a CUDA "
                    "driver this backend can use",
                    model, gi->name, library, symbols[i].symbol);
    }
    /* dlsym returns functions as void*; POSIX guarantees the round trip. */
    memcpy((char*)&gi->cu + symbols[i].offset, &fn, sizeof fn);
  }
  CUresult result = gi->cu.init(0);
  if (result != RTS_CUDA_SUCCESS) {
    const char* name = NULL;
    if (gi->cu.get_error_name(result, &name) != RTS_CUDA_SUCCESS) name = NULL;
    return errorf(RTS_ERROR_UNAVAILABLE,
                  "model '%s' instance '%s' is KIND_GPU (device %d), and a GPU instance needs a CUDA device: "
                  "cuInit from '%s' failed with %s (%d)",
                  model, gi->name, gi->device, library, name ? name : "CUDA error", result);
  }
  CUDA_RETURN_IF_ERROR(gi, gi->cu.device_get(&gi->cu_device, gi->device), "cuDeviceGet");
  CUDA_RETURN_IF_ERROR(gi, gi->cu.primary_ctx_retain(&gi->context, gi->cu_device), "cuDevicePrimaryCtxRetain");
  CUDA_RETURN_IF_ERROR(gi, gi->cu.ctx_push(gi->context), "cuCtxPushCurrent");
  CUresult made = gi->cu.stream_create(&gi->stream, RTS_CU_STREAM_NON_BLOCKING);
  CUcontext popped = NULL;
  gi->cu.ctx_pop(&popped);
  if (made != RTS_CUDA_SUCCESS) {
    gi->stream = NULL;
    return cuda_error(gi, made, "cuStreamCreate");
  }
  return NULL;
}

static void instance_free(rts_instance* gi) {
  if (gi == NULL) return;
  if (gi->context != NULL) {
    if (gi->cu.ctx_push(gi->context) == RTS_CUDA_SUCCESS) {
      if (gi->scratch != 0) gi->cu.mem_free(gi->scratch);
      if (gi->stream != NULL) gi->cu.stream_destroy(gi->stream);
      CUcontext popped = NULL;
      gi->cu.ctx_pop(&popped);
    }
    gi->cu.primary_ctx_release(gi->cu_device);
  }
  if (gi->library != NULL) dlclose(gi->library);
  free(gi);
}

/* Copies `bytes` on the instance's stream, by the route the two memory types call for. */
static TRITONSERVER_Error* gpu_copy(
    rts_instance* gi, void* dst, int dst_type, const void* src, int src_type, uint64_t bytes) {
  if (bytes == 0) return NULL;
  const rts_route route = copy_route(src_type, dst_type);
  switch (route) {
    case ROUTE_DTOD:
      CUDA_RETURN_IF_ERROR(gi, gi->cu.memcpy_dtod((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src,
                                                  bytes, gi->stream), "cuMemcpyDtoDAsync");
      break;
    case ROUTE_HTOD:
      CUDA_RETURN_IF_ERROR(gi, gi->cu.memcpy_htod((CUdeviceptr)(uintptr_t)dst, src, bytes, gi->stream),
                           "cuMemcpyHtoDAsync");
      break;
    case ROUTE_DTOH:
      CUDA_RETURN_IF_ERROR(gi, gi->cu.memcpy_dtoh(dst, (CUdeviceptr)(uintptr_t)src, bytes, gi->stream),
                           "cuMemcpyDtoHAsync");
      break;
    case ROUTE_HOST_VIA_DEVICE:
      if (gi->scratch_size < bytes) {
        /* the stream's earlier copies may still read the old buffer */
        CUDA_RETURN_IF_ERROR(gi, gi->cu.stream_synchronize(gi->stream), "cuStreamSynchronize");
        if (gi->scratch != 0) gi->cu.mem_free(gi->scratch);
        gi->scratch = 0;
        gi->scratch_size = 0;
        CUDA_RETURN_IF_ERROR(gi, gi->cu.mem_alloc(&gi->scratch, bytes), "cuMemAlloc");
        gi->scratch_size = bytes;
      }
      CUDA_RETURN_IF_ERROR(gi, gi->cu.memcpy_htod(gi->scratch, src, bytes, gi->stream), "cuMemcpyHtoDAsync");
      CUDA_RETURN_IF_ERROR(gi, gi->cu.memcpy_dtoh(dst, gi->scratch, bytes, gi->stream), "cuMemcpyDtoHAsync");
      break;
  }
  gi->route_copies[route] += 1;
  gi->route_bytes[route] += bytes;
  return NULL;
}

/* ---- the ops ---- */

/* The probe's reports, each written when the request asks for it (Triton lists every output
 * when a client names none). */
static TRITONSERVER_Error* write_probe_reports(
    TRITONBACKEND_Request* request, TRITONBACKEND_Response* response, rts_instance* gi,
    const uint64_t addresses[4], const uint64_t memory[4]) {
  const int64_t shape[1] = {4};
  const struct {
    const char* name;
    const uint64_t* values;
  } reports[2] = {{"ADDRESSES", addresses}, {"MEMORY", memory}};
  for (int r = 0; r < 2; ++r) {
    if (!output_requested(request, reports[r].name)) continue;
    char* buffer = NULL;
    if (gi != NULL && gi->gpu) {
      int got_type = RTS_MEMORY_GPU;
      int64_t got_id = gi->device;
      RETURN_IF_ERROR(output_alloc(response, reports[r].name, RTS_TYPE_UINT64, shape, 1, 4 * sizeof(uint64_t),
                                   &buffer, &got_type, &got_id));
      RETURN_IF_ERROR(gpu_copy(gi, buffer, got_type, reports[r].values, RTS_MEMORY_CPU, 4 * sizeof(uint64_t)));
    } else {
      RETURN_IF_ERROR(output_get(response, reports[r].name, RTS_TYPE_UINT64, shape, 1, 4 * sizeof(uint64_t),
                                 &buffer, NULL, NULL));
      memcpy(buffer, reports[r].values, 4 * sizeof(uint64_t));
    }
  }
  return NULL;
}

static TRITONSERVER_Error* run_identity(
    TRITONBACKEND_Request* request, TRITONBACKEND_Response* response, bool probe,
    uint64_t* compute_start, uint64_t* compute_end) {
  rts_input in;
  RETURN_IF_ERROR(input_get(request, "INPUT0", RTS_TYPE_FP32, 4, &in));
  char* out = NULL;
  int out_type = RTS_MEMORY_CPU;
  int64_t out_id = 0;
  TRITONSERVER_Error* err =
      output_get(response, "OUTPUT0", RTS_TYPE_FP32, in.shape, in.dims, in.byte_size, &out, &out_type, &out_id);
  if (err == NULL) {
    *compute_start = now_ns();
    if (in.byte_size > 0) memcpy(out, in.data, in.byte_size);
    *compute_end = now_ns();
  }
  if (err == NULL && probe) {
    /* gathered == NULL: the address is the server's buffer itself, never a copy of ours */
    const uint64_t addresses[4] = {
        in.gathered ? 0 : (uint64_t)(uintptr_t)in.data, in.byte_size, (uint64_t)(uintptr_t)out, in.byte_size};
    const uint64_t memory[4] = {
        (uint64_t)in.memory_type, (uint64_t)in.memory_type_id, (uint64_t)out_type, (uint64_t)out_id};
    err = write_probe_reports(request, response, NULL, addresses, memory);
  }
  input_free(&in);
  return err;
}

/* GPU instances: identity (and probe) through the instance's GPU, with no host copy when both
 * buffers Triton hands over are GPU memory. */
static TRITONSERVER_Error* run_identity_gpu(
    rts_instance* gi, TRITONBACKEND_Request* request, TRITONBACKEND_Response* response, bool probe,
    uint64_t* compute_start, uint64_t* compute_end) {
  rts_input in;
  RETURN_IF_ERROR(input_properties(request, "INPUT0", RTS_TYPE_FP32, 4, &in));
  char* out = NULL;
  int out_type = RTS_MEMORY_GPU; /* asked for: GPU memory on the instance's device */
  int64_t out_id = gi->device;
  RETURN_IF_ERROR(
      output_alloc(response, "OUTPUT0", RTS_TYPE_FP32, in.shape, in.dims, in.byte_size, &out, &out_type, &out_id));
  CUDA_RETURN_IF_ERROR(gi, gi->cu.ctx_push(gi->context), "cuCtxPushCurrent");
  TRITONSERVER_Error* err = NULL;
  uint64_t filled = 0;
  const void* first = NULL;
  *compute_start = now_ns();
  for (uint32_t b = 0; b < in.buffers && err == NULL; ++b) {
    const void* piece = NULL;
    uint64_t piece_size = 0;
    int memory_type = RTS_MEMORY_GPU; /* asked for; Triton answers with what the buffer is */
    int64_t memory_type_id = gi->device;
    err = TRITONBACKEND_InputBuffer(in.handle, b, &piece, &piece_size, &memory_type, &memory_type_id);
    if (err != NULL) break;
    if (b == 0) {
      first = piece;
      in.memory_type = memory_type;
      in.memory_type_id = memory_type_id;
    }
    if (filled + piece_size > in.byte_size) {
      err = errorf(RTS_ERROR_INVALID_ARG, "input 'INPUT0' buffers hold more than its %llu bytes",
                   (unsigned long long)in.byte_size);
      break;
    }
    err = gpu_copy(gi, out + filled, out_type, piece, memory_type, piece_size);
    filled += piece_size;
  }
  if (err == NULL && filled != in.byte_size) {
    err = errorf(RTS_ERROR_INVALID_ARG, "input 'INPUT0' buffers hold %llu of its %llu bytes",
                 (unsigned long long)filled, (unsigned long long)in.byte_size);
  }
  if (err == NULL && probe) {
    const uint64_t addresses[4] = {
        in.buffers == 1 ? (uint64_t)(uintptr_t)first : 0, in.byte_size, (uint64_t)(uintptr_t)out, in.byte_size};
    const uint64_t memory[4] = {
        (uint64_t)in.memory_type, (uint64_t)in.memory_type_id, (uint64_t)out_type, (uint64_t)out_id};
    err = write_probe_reports(request, response, gi, addresses, memory);
  }
  /* Triton reads the outputs once the response is sent: every copy must be done by then. */
  CUresult synced = gi->cu.stream_synchronize(gi->stream);
  *compute_end = now_ns();
  if (err == NULL && synced != RTS_CUDA_SUCCESS) err = cuda_error(gi, synced, "cuStreamSynchronize");
  CUcontext popped = NULL;
  gi->cu.ctx_pop(&popped);
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
    err = output_get(response, "OUTPUT0", RTS_TYPE_FP32, shape0, 2, batch * MULTI_IO_ROWS * 4, &out0, NULL, NULL);
  }
  if (err == NULL) {
    const int64_t shape1[2] = {(int64_t)batch, MULTI_IO_PAIRS};
    err = output_get(response, "OUTPUT1", RTS_TYPE_INT32, shape1, 2, batch * MULTI_IO_PAIRS * 4, &out1, NULL, NULL);
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

/* The string parameter `key` of the config, from the config as JSON ("" when absent). */
static void parse_param(const char* json, size_t size, const char* key, char* found, size_t found_size) {
  char pattern[96];
  const int n_pattern = snprintf(pattern, sizeof pattern, "\"%s\":{\"string_value\":\"", key);
  found[0] = '\0';
  if (n_pattern <= 0 || (size_t)n_pattern >= sizeof pattern) return;
  const size_t pattern_size = (size_t)n_pattern;
  const char* end = json + size;
  for (const char* at = json; at + pattern_size <= end; ++at) {
    if (memcmp(at, pattern, pattern_size) != 0) continue;
    const char* value = at + pattern_size;
    size_t n = 0;
    while (value + n < end && value[n] != '"' && n + 1 < found_size) ++n;
    memcpy(found, value, n);
    found[n] = '\0';
    break;
  }
}

static rts_op op_from_name(const char* name) {
  if (strcmp(name, "identity") == 0) return OP_IDENTITY;
  if (strcmp(name, "multi_io") == 0) return OP_MULTI_IO;
  if (strcmp(name, "probe") == 0) return OP_PROBE;
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
  char driver[256];
  op_name[0] = driver[0] = '\0';
  if (err == NULL) {
    parse_param(json, json_size, "op", op_name, sizeof op_name);
    parse_param(json, json_size, "cuda_driver", driver, sizeof driver);
  }
  drop(TRITONSERVER_MessageDelete(config));
  if (err != NULL) return err;
  const rts_op op = op_from_name(op_name);
  if (op == 0) {
    return errorf(RTS_ERROR_INVALID_ARG,
                  "model '%s': parameter \"op\" is '%s'; rts_native knows identity, multi_io, probe",
                  name, op_name);
  }
  rts_model* state = calloc(1, sizeof *state);
  if (state == NULL) return errorf(RTS_ERROR_INTERNAL, "out of memory");
  state->op = op;
  snprintf(state->name, sizeof state->name, "%s", name);
  snprintf(state->cuda_driver, sizeof state->cuda_driver, "%s", driver[0] ? driver : RTS_DEFAULT_CUDA_DRIVER);
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

RTS_EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceInitialize(TRITONBACKEND_ModelInstance* instance) {
  TRITONBACKEND_Model* model = NULL;
  RETURN_IF_ERROR(TRITONBACKEND_ModelInstanceModel(instance, &model));
  void* model_state = NULL;
  RETURN_IF_ERROR(TRITONBACKEND_ModelState(model, &model_state));
  const rts_model* m = (const rts_model*)model_state;
  int kind = RTS_KIND_CPU;
  int32_t device = 0;
  const char* instance_name = NULL;
  RETURN_IF_ERROR(TRITONBACKEND_ModelInstanceKind(instance, &kind));
  RETURN_IF_ERROR(TRITONBACKEND_ModelInstanceDeviceId(instance, &device));
  RETURN_IF_ERROR(TRITONBACKEND_ModelInstanceName(instance, &instance_name));
  if (kind != RTS_KIND_GPU) return NULL; /* CPU instances keep no state of their own */
  if (m->op == OP_MULTI_IO) {
    return errorf(RTS_ERROR_INVALID_ARG,
                  "model '%s': op multi_io runs on KIND_CPU instances only; KIND_GPU instances run identity "
                  "and probe",
                  m->name);
  }
  rts_instance* gi = calloc(1, sizeof *gi);
  if (gi == NULL) return errorf(RTS_ERROR_INTERNAL, "out of memory");
  gi->gpu = true;
  gi->device = device;
  snprintf(gi->name, sizeof gi->name, "%s", instance_name ? instance_name : "?");
  TRITONSERVER_Error* err = cuda_open(gi, m->name, m->cuda_driver);
  if (err == NULL) err = TRITONBACKEND_ModelInstanceSetState(instance, gi);
  if (err != NULL) {
    instance_free(gi);
    return err;
  }
  logf_info(__LINE__, "rts_native: model '%s' instance '%s' runs on GPU %d (CUDA driver '%s')", m->name,
            gi->name, gi->device, m->cuda_driver);
  return NULL;
}

RTS_EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceFinalize(TRITONBACKEND_ModelInstance* instance) {
  void* state = NULL;
  RETURN_IF_ERROR(TRITONBACKEND_ModelInstanceState(instance, &state));
  rts_instance* gi = (rts_instance*)state;
  if (gi == NULL) return NULL;
  /* What this GPU instance moved, by route: the log says whether any copy touched the host. */
  char line[384];
  int used = snprintf(line, sizeof line, "rts_native: instance '%s' on GPU %d copied", gi->name, gi->device);
  for (int r = 0; r < RTS_ROUTES && used > 0 && (size_t)used < sizeof line; ++r) {
    used += snprintf(line + used, sizeof line - (size_t)used, "%s %s %llu buffers %llu bytes", r ? ";" : "",
                     route_names[r], (unsigned long long)gi->route_copies[r],
                     (unsigned long long)gi->route_bytes[r]);
  }
  logf_info(__LINE__, "%s", line);
  instance_free(gi);
  return NULL;
}

RTS_EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests, const uint32_t request_count) {
  TRITONBACKEND_Model* model = NULL;
  RETURN_IF_ERROR(TRITONBACKEND_ModelInstanceModel(instance, &model));
  void* state = NULL;
  RETURN_IF_ERROR(TRITONBACKEND_ModelState(model, &state));
  const rts_op op = ((rts_model*)state)->op;
  void* instance_state = NULL;
  RETURN_IF_ERROR(TRITONBACKEND_ModelInstanceState(instance, &instance_state));
  rts_instance* gi = (rts_instance*)instance_state; /* NULL: a CPU instance */
  const uint64_t exec_start = now_ns();
  uint64_t batch_compute_start = 0, batch_compute_end = 0;
  for (uint32_t r = 0; r < request_count; ++r) {
    TRITONBACKEND_Request* request = requests[r];
    const uint64_t request_start = now_ns();
    uint64_t compute_start = 0, compute_end = 0;
    TRITONBACKEND_Response* response = NULL;
    TRITONSERVER_Error* err = TRITONBACKEND_ResponseNew(&response, request);
    if (err == NULL) {
      if (gi != NULL) {
        err = run_identity_gpu(gi, request, response, op == OP_PROBE, &compute_start, &compute_end);
      } else if (op == OP_MULTI_IO) {
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
