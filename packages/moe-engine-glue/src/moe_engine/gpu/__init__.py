"""GPU experts: Triton grouped GEMV/GEMM kernels per weight format over GPU-resident expert slots."""
