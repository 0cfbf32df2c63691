"""Weights moved into huge pages keep every value, shape, stride and sharing, and land in a mapping the OS may back
with transparent huge pages."""
import mmap
from pathlib import Path

import pytest
import torch

from engine.model.huge_pages import move_to_huge_pages

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class Holder(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        self.tied = torch.nn.Linear(80, 48, bias=False)
        self.tied.weight = linear.weight  # one Parameter in two modules, as tied embeddings are
        self.register_buffer("codes", torch.arange(300, dtype=torch.int64).to(torch.uint8).reshape(3, 100))
        self.register_buffer("absent", None)


def _modules():
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80)
    linear.weight = torch.nn.Parameter(linear.weight.detach().t().contiguous().t(), requires_grad=False)  # input-major
    return linear, Holder(linear)


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="this OS has no MADV_HUGEPAGE to move weights with")
def test_moved_tensors_keep_values_shapes_strides_and_sharing():
    linear, holder = _modules()
    before = {name: (t.clone(), t.shape, t.stride()) for name, t in holder.state_dict().items()}
    unique = {t.data_ptr(): t for t in holder.state_dict().values()}.values()
    x = torch.randn(5, 48)
    expected = linear(x)
    moved = move_to_huge_pages([holder, linear])  # the Linear reached twice: moved once
    assert moved >= sum(t.numel() * t.element_size() for t in unique)
    for name, tensor in holder.state_dict().items():
        values, shape, stride = before[name]
        assert torch.equal(tensor, values) and tensor.shape == shape and tensor.stride() == stride, name
    assert isinstance(linear.weight, torch.nn.Parameter) and not linear.weight.requires_grad
    assert torch.equal(linear(x), expected)
    assert holder.linear.weight is linear.weight and holder.absent is None
    assert holder.tied.weight is linear.weight  # moved once, still shared


@pytest.mark.skipif(not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(),
                    reason="the OS here has transparent huge pages off: no mapping may use them")
def test_moved_tensors_lie_in_a_mapping_eligible_for_huge_pages():
    _, holder = _modules()
    holder.codes = torch.ones(4 << 20, dtype=torch.uint8)  # a mapping smaller than a huge page can hold none
    move_to_huge_pages([holder])
    address = holder.codes.data_ptr()
    assert _smaps_field(address, "THPeligible") == "1"


def _smaps_field(address: int, field: str) -> str:
    """FIELD of the mapping in /proc/self/smaps that holds ADDRESS."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith(field + ":"):
            return line.split()[1]
    raise AssertionError(f"no mapping holds {address:#x}")
