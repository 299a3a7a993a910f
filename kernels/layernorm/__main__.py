"""``python -m kernels.layernorm``: print the launch configuration each row width gets."""

from kernels.layernorm.configs import table

print(table())
