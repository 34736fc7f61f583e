"""Hopper kernels. Importing this package imports Pallas Mosaic GPU."""
from collective_matmul.kernels.all_gather_matmul import all_gather_lhs_matmul
from collective_matmul.kernels.tuning import AllGatherMatmulConfig
from collective_matmul.kernels.tuning import select_config
from collective_matmul.kernels.tuning import select_reduce_scatter_config
from collective_matmul.kernels.tuning import unsupported_reason
from collective_matmul.kernels.autotuning import autotune
from collective_matmul.kernels.matmul_reduce_scatter import matmul_reduce_scatter
