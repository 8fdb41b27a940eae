"""The front's two ways of reading a torch tensor write the same validator record (issue 39, item 2).

pakv_front.c reads an exact CPU ``torch.Tensor`` through DLPack's C exchange table where torch
offers one (``torch.Tensor.__dlpack_c_exchange_api__``: one C call, no Python object made) and
through five attribute reads otherwise (older torch, or a tensor DLPack cannot describe). Each
test here describes the same tensors both ways and compares the records byte for byte (the data
address, element type, rank, dims, strides, device), and the host copies kept alive for index
tensors; a refusal must be the same error either way.
"""

from __future__ import annotations

import ctypes
import warnings

import pytest
import torch

from pakv_onnx import native_lib, validator
from pakv_onnx.spec import ONNX_ELEMENT_TYPE_OF

HAS_EXCHANGE = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
INDEX, OPTIONAL = 2, 1


@pytest.fixture
def front():
    """The configured extension; the validator's own configuration is restored afterwards."""
    module = native_lib.front()
    validator._describer()
    yield module
    validator._describer()


def describe(front, values: tuple, roles: tuple, dlpack: bool) -> tuple[bytes, list]:
    """(the records' bytes, the hosts list) of ``values`` described through one route."""
    exchange = torch.Tensor.__dlpack_c_exchange_api__ if dlpack else None
    dl_types = validator._dlpack_element_types(front, exchange) if dlpack else None
    front.configure(torch.Tensor, dict(ONNX_ELEMENT_TYPE_OF), validator._describe_other, exchange, dl_types)
    assert front.reads_dlpack() is dlpack
    records = (native_lib.Tensor * len(values))()
    hosts = front.describe(ctypes.addressof(records), values, roles)
    return bytes(records), hosts


def assert_same_records(front, values: tuple, roles: tuple | None = None) -> None:
    roles = roles or tuple((f"t{i}", 0) for i in range(len(values)))
    by_dlpack, dl_hosts = describe(front, values, roles, dlpack=True)
    by_attributes, attr_hosts = describe(front, values, roles, dlpack=False)
    assert by_dlpack == by_attributes
    assert [id(h) for h in dl_hosts] == [id(h) for h in attr_hosts]


def every_dtype() -> list[torch.dtype]:
    dtypes = []
    for dtype in sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.empty(0, dtype=dtype)
        except (RuntimeError, TypeError):
            continue
        dtypes.append(dtype)
    return dtypes


pytestmark = pytest.mark.skipif(not HAS_EXCHANGE, reason="this torch has no DLPack C exchange table")


def test_the_validator_reads_cpu_tensors_through_dlpack_where_torch_offers_it() -> None:
    validator._describer()
    assert native_lib.front().reads_dlpack()


@pytest.mark.parametrize("dtype", every_dtype(), ids=str)
def test_every_dtype_gets_the_element_type_of_its_torch_dtype(front, dtype: torch.dtype) -> None:
    """int8 and int4 share DLPack's (int, 8 bits): such types are looked up by their torch dtype."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensor = torch.empty(2, 3, dtype=dtype)
    assert_same_records(front, (tensor,))
    records = (native_lib.Tensor * 1)()
    front.describe(ctypes.addressof(records), (tensor,), (("t", 0),))
    assert records[0].elem_type == ONNX_ELEMENT_TYPE_OF.get(dtype, 0)


def layouts() -> dict[str, torch.Tensor]:
    pool = torch.arange(4 * 2 * 16 * 3 * 8, dtype=torch.float32).reshape(4, 2, 16, 3, 8)
    return {
        "contiguous": pool[0].clone(),
        "pool view (strided on dim 0)": pool[:, 0],
        "storage offset": pool[1:, 1],
        "transposed": pool[0, 0].transpose(0, 2),
        "stepped": pool[::2, :, ::3],
        "expanded (stride 0)": torch.zeros(1, 3, 8).expand(5, 3, 8),
        "scalar": torch.tensor(7.0),
        "empty": torch.empty(0, 3, 8),
        "empty with odd strides": torch.empty_strided((2, 0, 3), (0, 5, 1)),
        "rank 9 (past the record's 8)": torch.zeros([1] * 7 + [2, 3]),
        "size-1 dims with odd strides": torch.empty_strided((1, 4, 1), (99, 1, 7)),
        "requires grad": torch.ones(3, 4, requires_grad=True),
        "channels last": torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last),
    }


@pytest.mark.parametrize("name", list(layouts()))
def test_layouts_are_described_alike(front, name: str) -> None:
    assert_same_records(front, (layouts()[name],))


def test_index_tensors_keep_their_host_tensor_and_optional_none_stays_absent(front) -> None:
    table = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    lengths = torch.tensor([0, 3, 5], dtype=torch.int64)[::2]
    roles = (("block_tables", INDEX), ("seq_lens", INDEX), ("seq_offset", INDEX | OPTIONAL))
    assert_same_records(front, (table, lengths, None), roles)
    _, hosts = describe(front, (table, lengths, None), roles, dlpack=True)
    assert hosts[0] is table and hosts[1] is lengths and hosts[2] is None


def test_what_is_not_a_plain_cpu_tensor_takes_the_python_path_either_way(front) -> None:
    parameter = torch.nn.Parameter(torch.ones(2, 3))
    meta = torch.empty(2, 3, device="meta")
    assert_same_records(front, (parameter, meta))


@pytest.mark.parametrize(
    "value",
    [torch.eye(3).to_sparse(), 3.0, None],
    ids=["sparse (DLPack refuses it)", "a float", "None where required"],
)
def test_refusals_are_the_same_either_way(front, value) -> None:
    errors = []
    for dlpack in (True, False):
        with pytest.raises((TypeError, RuntimeError, ValueError)) as info:
            describe(front, (value,), (("key_cache", 0),), dlpack)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]


def test_the_dtype_probe_reads_only_the_tensors_the_table_came_from(front) -> None:
    """DLPack's table may be handed only objects of its own type: anything else is refused by name."""
    exchange = torch.Tensor.__dlpack_c_exchange_api__
    assert front.dlpack_key(exchange, torch.empty(0, dtype=torch.bfloat16)) == 4 | 16 << 8 | 1 << 16
    with pytest.raises(TypeError, match="float.* is not read by this exchange table"):
        front.dlpack_key(exchange, 3.0)
