"""The maths the families are written in: the exact layers (`layers`), the fused
parameter layout and fast kernels (`fused`, `kernels`), and the input checks
(`checks`, `values`). Imports only torch and `sharding`."""
