"""Built-in scenarios, one module per fix family (mooncake F1/F2, nixl F4, mori F3, f5)."""
