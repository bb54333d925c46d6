"""Random tables and poison values for the kernel tests (never zeros)."""
import torch

POISON_INT = {torch.uint8: 0xA5, torch.int8: -91, torch.int16: -23131, torch.int32: -1515870811,
              torch.int64: -6510615555426900571}


def random_table(rows: int, cols: int, dtype: torch.dtype, gen: torch.Generator, device) -> torch.Tensor:
    if dtype.is_floating_point:
        t = torch.randn(rows, cols, generator=gen).to(dtype)
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(info.min, info.max, (rows, cols), generator=gen, dtype=torch.int64).to(dtype)
    return t.to(device)


def poisoned(rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.full((rows, cols), float("nan"), dtype=dtype, device=device)
    return torch.full((rows, cols), POISON_INT[dtype], dtype=dtype, device=device)


def is_poison(t: torch.Tensor) -> torch.Tensor:
    """Row mask: every element of the row still holds the poison."""
    if t.dtype.is_floating_point:
        return torch.isnan(t).all(dim=1)
    return (t == POISON_INT[t.dtype]).all(dim=1)
