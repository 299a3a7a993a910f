"""``python -m kernels.dropout``: print the launch configuration of the dropout kernel."""

from kernels.dropout.configs import table

print(table())
