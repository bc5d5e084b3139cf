"""How good the representation is: the paper's tables, the label loop, the frozen-feature choice, the RCDM check."""
