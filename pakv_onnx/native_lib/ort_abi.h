/* The small subset of the ONNX Runtime C ABI this plugin uses, declared from the public
 * header's facts (include/onnxruntime/core/session/onnxruntime_c_api.h of microsoft/onnxruntime):
 * the order of function slots in OrtApi, the field order of OrtCustomOp, and a few enum values.
 *
 * No ORT header is included and libonnxruntime is never linked: the plugin only calls through
 * the OrtApi table ORT hands to RegisterCustomOps. Slot indices (counted from 0) were checked
 * against the header; they are stable because ORT only ever appends to OrtApi.
 */
#ifndef PAKV_ORT_ABI_H
#define PAKV_ORT_ABI_H

#include <stddef.h>
#include <stdint.h>

/* The API version this plugin is written against: ORT 1.16 (CreateKernelV2 / KernelComputeV2).
 * With a runtime of API >= 17 the ops also declare their opset range (pakv opset 1 only). */
#define PAKV_ORT_API_VERSION 16
#define PAKV_ORT_API_OPSET_RANGE 17
/* With a runtime of API >= 18 the write op declares its cache inputs aliased to its outputs. */
#define PAKV_ORT_API_ALIAS_MAP 18
/* KernelContext_ParallelFor (ORT's intra-op pool) exists from API 17 (ORT 1.17) on. */
#define PAKV_ORT_API_PARALLEL_FOR 17
/* GetTensorElementTypeAndShapeDataReference (a tensor's element type and a pointer to its own dims, nothing
 * allocated) exists from API 24 (ORT 1.24) on; older runtimes: the OrtTensorTypeAndShapeInfo route. */
#define PAKV_ORT_API_SHAPE_REFERENCE 24

typedef struct OrtStatus OrtStatus;
typedef struct OrtApi OrtApi;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtMemoryInfo OrtMemoryInfo;

/* OrtErrorCode */
enum { PAKV_ORT_OK = 0, PAKV_ORT_FAIL = 1, PAKV_ORT_INVALID_ARGUMENT = 2 };

/* OrtCustomOpInputOutputCharacteristic */
enum { PAKV_ORT_REQUIRED = 0, PAKV_ORT_OPTIONAL = 1 };

/* OrtMemType (what OrtCustomOp.GetInputMemoryType answers): CPUInput = the input is delivered in
 * host memory to an op of a device execution provider. */
enum { PAKV_ORT_MEM_CPU_INPUT = -2, PAKV_ORT_MEM_DEFAULT = 0 };

/* OrtMemoryInfoDeviceType (MemoryInfoGetDeviceType) */
enum { PAKV_ORT_DEVICE_CPU = 0, PAKV_ORT_DEVICE_GPU = 1, PAKV_ORT_DEVICE_FPGA = 2, PAKV_ORT_DEVICE_NPU = 3 };

typedef struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)(void);
} OrtApiBase;

/* OrtApi slot indices used here (see the header's struct OrtApi). This is the only place they are
 * written: tests/native/fake_ort_driver.c includes this header to fill its fake table. */
enum {
  PAKV_SLOT_CreateStatus = 0,
  PAKV_SLOT_GetErrorMessage = 2,
  PAKV_SLOT_CreateCustomOpDomain = 26,
  PAKV_SLOT_CustomOpDomain_Add = 27,
  PAKV_SLOT_AddCustomOpDomain = 28,
  PAKV_SLOT_GetTensorMutableData = 51,
  PAKV_SLOT_GetTensorElementType = 60,
  PAKV_SLOT_GetDimensionsCount = 61,
  PAKV_SLOT_GetDimensions = 62,
  PAKV_SLOT_GetTensorTypeAndShape = 65,
  PAKV_SLOT_MemoryInfoGetId = 72,
  PAKV_SLOT_KernelInfoGetAttribute_float = 85,
  PAKV_SLOT_KernelInfoGetAttribute_int64 = 86,
  PAKV_SLOT_KernelInfoGetAttribute_string = 87,
  PAKV_SLOT_KernelContext_GetInputCount = 88,
  PAKV_SLOT_KernelContext_GetOutputCount = 89,
  PAKV_SLOT_KernelContext_GetInput = 90,
  PAKV_SLOT_KernelContext_GetOutput = 91,
  PAKV_SLOT_ReleaseStatus = 93,
  PAKV_SLOT_ReleaseTensorTypeAndShapeInfo = 99,
  PAKV_SLOT_AddSessionConfigEntry = 130,                /* API 5 */
  PAKV_SLOT_KernelInfoGetAttributeArray_float = 162,    /* API 8 */
  PAKV_SLOT_KernelInfoGetAttributeArray_int64 = 163,    /* API 8 */
  PAKV_SLOT_KernelContext_GetGPUComputeStream = 193,    /* API 10 */
  PAKV_SLOT_GetTensorMemoryInfo = 194,                  /* API 10 */
  PAKV_SLOT_MemoryInfoGetDeviceType = 225,              /* API 14 */
  PAKV_SLOT_KernelInfo_GetOutputCount = 231,            /* API 14 */
  PAKV_SLOT_KernelInfo_GetInputName = 232,              /* API 14 */
  PAKV_SLOT_KernelInfo_GetOutputName = 233,             /* API 14 */
  PAKV_SLOT_HasSessionConfigEntry = 237,                /* API 14 */
  PAKV_SLOT_GetSessionConfigEntry = 238,                /* API 14 */
  PAKV_SLOT_KernelInfo_GetNodeName = 244,               /* API 15 */
  PAKV_SLOT_KernelInfoGetConstantInput_tensor = 249,    /* API 15 */
  PAKV_SLOT_KernelContext_ParallelFor = 274,            /* API 17: call only on runtimes >= 1.17 */
  PAKV_SLOT_GetTensorElementTypeAndShapeDataReference = 414, /* API 24 (its last slot): runtimes >= 1.24 only */
  PAKV_SLOT_COUNT_USED = 415,                           /* one past the highest slot used */
};

/* Function types of those slots. */
typedef OrtStatus* (*pakv_CreateStatus_fn)(int code, const char* msg);
typedef const char* (*pakv_GetErrorMessage_fn)(const OrtStatus* status);
typedef OrtStatus* (*pakv_CreateCustomOpDomain_fn)(const char* domain, OrtCustomOpDomain** out);
typedef OrtStatus* (*pakv_CustomOpDomain_Add_fn)(OrtCustomOpDomain* domain, const void* op);
typedef OrtStatus* (*pakv_AddCustomOpDomain_fn)(OrtSessionOptions* options, OrtCustomOpDomain* domain);
typedef OrtStatus* (*pakv_GetTensorMutableData_fn)(OrtValue* value, void** out);
typedef OrtStatus* (*pakv_GetTensorElementType_fn)(const OrtTensorTypeAndShapeInfo* info, int* out);
typedef OrtStatus* (*pakv_GetDimensionsCount_fn)(const OrtTensorTypeAndShapeInfo* info, size_t* out);
typedef OrtStatus* (*pakv_GetDimensions_fn)(const OrtTensorTypeAndShapeInfo* info, int64_t* dims, size_t n);
typedef OrtStatus* (*pakv_GetTensorTypeAndShape_fn)(const OrtValue* value, OrtTensorTypeAndShapeInfo** out);
/* The dims pointer is the value's own (valid while the value is; NULL with a count of 0 for a scalar). */
typedef OrtStatus* (*pakv_GetTensorElementTypeAndShapeDataReference_fn)(const OrtValue* value, int* elem_type,
                                                                       const int64_t** dims, size_t* count);
typedef OrtStatus* (*pakv_KernelInfoGetAttribute_float_fn)(const OrtKernelInfo* info, const char* name, float* out);
typedef OrtStatus* (*pakv_KernelInfoGetAttributeArray_float_fn)(const OrtKernelInfo* info, const char* name, float* out,
                                                                size_t* size);
typedef OrtStatus* (*pakv_KernelInfoGetAttributeArray_int64_fn)(const OrtKernelInfo* info, const char* name,
                                                                int64_t* out, size_t* size);
typedef OrtStatus* (*pakv_AddSessionConfigEntry_fn)(OrtSessionOptions* options, const char* key, const char* value);
typedef OrtStatus* (*pakv_HasSessionConfigEntry_fn)(const OrtSessionOptions* options, const char* key, int* out);
typedef OrtStatus* (*pakv_GetSessionConfigEntry_fn)(const OrtSessionOptions* options, const char* key, char* value,
                                                    size_t* size);
typedef OrtStatus* (*pakv_KernelInfoGetAttribute_int64_fn)(const OrtKernelInfo* info, const char* name, int64_t* out);
typedef OrtStatus* (*pakv_KernelInfoGetAttribute_string_fn)(const OrtKernelInfo* info, const char* name, char* out,
                                                            size_t* size);
typedef OrtStatus* (*pakv_KernelContext_GetCount_fn)(const OrtKernelContext* ctx, size_t* out);
typedef OrtStatus* (*pakv_KernelContext_GetInput_fn)(const OrtKernelContext* ctx, size_t index, const OrtValue** out);
typedef OrtStatus* (*pakv_KernelContext_GetOutput_fn)(OrtKernelContext* ctx, size_t index, const int64_t* dims,
                                                      size_t n, OrtValue** out);
typedef void (*pakv_ReleaseStatus_fn)(OrtStatus* status);
typedef OrtStatus* (*pakv_MemoryInfoGetId_fn)(const OrtMemoryInfo* info, int* out);
typedef OrtStatus* (*pakv_KernelContext_GetGPUComputeStream_fn)(const OrtKernelContext* ctx, void** out);
typedef OrtStatus* (*pakv_GetTensorMemoryInfo_fn)(const OrtValue* value, const OrtMemoryInfo** out);
typedef void (*pakv_MemoryInfoGetDeviceType_fn)(const OrtMemoryInfo* info, int* out); /* returns no status */
typedef OrtStatus* (*pakv_KernelContext_ParallelFor_fn)(const OrtKernelContext* ctx, void (*fn)(void*, size_t),
                                                       size_t total, size_t num_batch, void* data);
typedef void (*pakv_ReleaseTensorTypeAndShapeInfo_fn)(OrtTensorTypeAndShapeInfo* info);
typedef OrtStatus* (*pakv_KernelInfo_GetInputName_fn)(const OrtKernelInfo* info, size_t index, char* out,
                                                     size_t* size);
typedef OrtStatus* (*pakv_KernelInfo_GetOutputCount_fn)(const OrtKernelInfo* info, size_t* out);
typedef OrtStatus* (*pakv_KernelInfo_GetOutputName_fn)(const OrtKernelInfo* info, size_t index, char* out,
                                                      size_t* size);
typedef OrtStatus* (*pakv_KernelInfo_GetNodeName_fn)(const OrtKernelInfo* info, char* out, size_t* size);
typedef OrtStatus* (*pakv_KernelInfoGetConstantInput_tensor_fn)(const OrtKernelInfo* info, size_t index,
                                                               int* is_constant, const OrtValue** out);

/* OrtApi is an array of function pointers; fetch slot `slot` cast to its type. */
#define PAKV_API(api, name) ((pakv_##name##_fn)(((void* const*)(api))[PAKV_SLOT_##name]))
#define PAKV_API_AS(api, name, type) ((pakv_##type##_fn)(((void* const*)(api))[PAKV_SLOT_##name]))

/* struct OrtCustomOp, field order of the header. Fields after KernelComputeV2 (API 17+) are only
 * read by ORT when version says so; they are declared here (and left NULL) so the struct is
 * never shorter than what a newer runtime might touch. */
typedef struct PakvOrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const struct PakvOrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const struct PakvOrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const struct PakvOrtCustomOp* op);
  int (*GetInputType)(const struct PakvOrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const struct PakvOrtCustomOp* op);
  int (*GetOutputType)(const struct PakvOrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const struct PakvOrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* ctx);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const struct PakvOrtCustomOp* op, size_t index);
  int (*GetOutputCharacteristic)(const struct PakvOrtCustomOp* op, size_t index);
  int (*GetInputMemoryType)(const struct PakvOrtCustomOp* op, size_t index);
  int (*GetVariadicInputMinArity)(const struct PakvOrtCustomOp* op);
  int (*GetVariadicInputHomogeneity)(const struct PakvOrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const struct PakvOrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const struct PakvOrtCustomOp* op);
  OrtStatus* (*CreateKernelV2)(const struct PakvOrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                               void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* ctx);
  /* API 17+ (read by ORT only when version >= 17). */
  void* InferOutputShapeFn;
  int (*GetStartVersion)(const struct PakvOrtCustomOp* op);
  int (*GetEndVersion)(const struct PakvOrtCustomOp* op);
  /* API 18+ (read by ORT only when version >= 18): in-place and alias maps. */
  size_t (*GetMayInplace)(int** input_index, int** output_index);
  void (*ReleaseMayInplace)(int* input_index, int* output_index);
  size_t (*GetAliasMap)(int** input_index, int** output_index);
  void (*ReleaseAliasMap)(int* input_index, int* output_index);
} PakvOrtCustomOp;

#endif /* PAKV_ORT_ABI_H */
