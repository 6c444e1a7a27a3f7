"""cuda-caching-allocator for Python: ``cuda_caching_allocator.torch.enable()`` installs the Rust
crate's caching allocator as PyTorch's CUDA allocator (see that module)."""

__all__ = ["torch"]
