"""Small built-in datasets and models, used by `stoker demo`, the docs and the benchmarks."""
