"""Pure logic with no SGLang import: index alignment, head-slice math, wire packing."""
