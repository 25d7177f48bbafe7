"""The maths the families are written in: the exact layers (`layers`), their fast eager
twins (`fast`, chosen in `kernels`) and the fused parameter layout they use (`fused`),
compile regions (`compile`), and the input checks (`checks`, `values`). Imports only
torch and `sharding`."""
