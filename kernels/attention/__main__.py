"""``python -m kernels.attention``: print the launch configuration each kind of call gets."""

from kernels.attention.configs import table

print("(BLOCK_M, BLOCK_N, warps, stages) per kernel: the first matching row of configs.ROWS\n")
print(table())
