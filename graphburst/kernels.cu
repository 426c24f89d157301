// graphburst device kernels: the one translation unit.
//
// Compiled once per device by NVRTC through cupy.RawModule (graphburst/kernels/launch.py
// inlines the local #includes below, so CuPy's compile cache keys on every section's text)
// and by nvcc in CI (-Werror, a syntax check only). The numpy twins in kernels/*_ref.py are
// the executable specification.
#include "kernels/common.cuh"
#include "kernels/burst.cuh"
#include "kernels/stubs.cuh"
#include "kernels/sampling.cuh"
#include "kernels/ngram.cuh"
#include "kernels/fields.cuh"
