"""Inputs for the digest kernels' tests (test/unit/test_verify_kernels.py), and a child-process
entry that runs the fused Triton kernel on them in Triton's CPU interpreter.

Why a child: Triton reads ``TRITON_INTERPRET`` when it is imported, and the test process has
imported it already (SGLang's utilities do), so the interpreter needs a process of its own.

    TRITON_INTERPRET=1 python test/support/digest_kernel_cases.py   # prints the totals as JSON
"""

import json

import numpy as np
import torch


def rows(n, item_len, seed):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, size=(n, item_len), dtype=np.uint8))


def cases(device="cpu"):
    """``(rows, component, buffer, dst_pages, index)`` requests of different widths: a host index,
    no index, an item that is not a multiple of 8 bytes, a device-side index, and an item longer
    than one step of the kernel (1030 words: a second, masked step)."""
    pool = rows(12, 32, 4)
    odd = rows(3, 13, 5)
    wide = rows(2, 8 * 1030, 6)
    return [
        (pool.to(device), 0, 3, [4, 0, 9], [5, 5, 1]),
        (odd.to(device), 2, 0, [1, 2, 3], None),
        (pool[:2].to(device), 0, 60, [70000, 8], None),
        (wide.to(device), 1, 2, [3, 3], torch.tensor([1, 0]).to(device)),
    ]


def items(device="cpu"):
    """The cases as the device paths take them (``rows_digests`` builds the same)."""
    from sglang_disagg_ext.backends.common.digest_kernels import _prepared_rows, _slot_factors
    from sglang_disagg_ext.core import digest as dg

    out = []
    for i, (r, c, b, pages, index) in enumerate(cases(device)):
        prepared_rows, prepared_index = _prepared_rows(r, index)
        out.append((i, prepared_rows, prepared_index, _slot_factors(pages), dg.buffer_factor(c, b)))
    return out


if __name__ == "__main__":
    from sglang_disagg_ext.backends.common.digest_kernels import _kernel_totals

    print(json.dumps(_kernel_totals(torch.device("cpu"), items("cpu"))))
