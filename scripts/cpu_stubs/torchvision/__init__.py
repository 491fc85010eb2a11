"""Import-only stand-in for torchvision on CPU test machines.

Why: SGLang imports torchvision at module level (``utils/common.py``,
``multimodal/internvl_utils.py``) but the transfer and memory-pool code this
project tests never calls it. The only torchvision wheel matching torch 2.13 is
a CUDA build that fails to load on CPU (``operator torchvision::nms does not
exist``). See ``import_only_stub.py`` for what the stand-in does.
"""

from import_only_stub import stand_in

stand_in(__name__, "no torchvision on this machine")
