/* Cache dtypes of the contract: ONNX TensorProto type -> element size.
 *
 * Mirrors pakv_onnx.spec.CACHE_DTYPES, in the same order; tests/test_native_abi.py parses this
 * table and fails if it differs from spec. tests/native/fake_ort_driver.c includes this header
 * instead of keeping its own copy.
 */
#ifndef PAKV_DTYPES_H
#define PAKV_DTYPES_H

/* ONNX element types (TensorProto.DataType, which ORT's ONNXTensorElementDataType equals) of the
 * index tensors (spec.INDEX_DTYPES), and 0 = undefined. */
enum { PAKV_ONNX_UNDEFINED = 0, PAKV_ONNX_INT32 = 6, PAKV_ONNX_INT64 = 7 };

typedef struct {
  int onnx_type;
  int itemsize;
  const char* name;
} pakv_dtype;

static const pakv_dtype PAKV_CACHE_DTYPES[] = {
    {16, 2, "bfloat16"},
    {10, 2, "float16"},
    {1, 4, "float32"},
    {3, 1, "int8"},
    {2, 1, "uint8"},
    {5, 2, "int16"},
    {4, 2, "uint16"},
    {6, 4, "int32"},
    {12, 4, "uint32"},
    {17, 1, "float8_e4m3fn"},
    {19, 1, "float8_e5m2"},
};
#define PAKV_NUM_DTYPES ((int)(sizeof(PAKV_CACHE_DTYPES) / sizeof(PAKV_CACHE_DTYPES[0])))

/* Index into PAKV_CACHE_DTYPES of an ONNX element type, or -1 outside the contract. */
static inline int pakv_dtype_index(int onnx_type) {
  for (int i = 0; i < PAKV_NUM_DTYPES; i++)
    if (PAKV_CACHE_DTYPES[i].onnx_type == onnx_type) return i;
  return -1;
}

#endif /* PAKV_DTYPES_H */
