"""Import-only stand-in for sgl_kernel (SGLang's CUDA kernels) on CPU test machines.

Why: on 0.5.10.post1 SGLang's decode module imports sgl_kernel at module level
through a chain the transfer path never calls (``disaggregation/decode.py:54`` ->
``managers/schedule_batch.py:71`` -> ``mem_cache/radix_cache.py:65`` ->
``mem_cache/hicache_storage.py:12`` -> ``mem_cache/memory_pool_host.py:47``:
``from sgl_kernel.kvcacheio import transfer_kv_...``), and the F10 metadata gate
replaces a function of that module. sgl_kernel has no CPU wheel. Later releases
import the decode module without it, so ``scripts/setup_venv.sh`` installs this
stand-in for 0.5.10.post1 only: elsewhere SGLang's own ``ImportError`` fallbacks
stay as they are. See ``import_only_stub.py`` for what the stand-in does.
"""

from import_only_stub import stand_in

stand_in(__name__, "sgl_kernel has no CPU build")
