// pybind11 peer for benchmarks/bench_bindings.py: vector_add(a, b) -> a + b.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>

namespace py = pybind11;
using f32_array = py::array_t<float, py::array::c_style | py::array::forcecast>;

static py::array_t<float> vector_add(f32_array a, f32_array b) {
    if (a.ndim() != 1 || b.ndim() != 1 || a.size() != b.size())
        throw std::invalid_argument("vector_add: expected two 1-D arrays of equal length");
    const py::ssize_t n = a.size();
    py::array_t<float> out(n);
    const float *pa = a.data(), *pb = b.data();
    float *po = out.mutable_data();
    for (py::ssize_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
    return out;
}

PYBIND11_MODULE(vadd_pybind11, m) {
    m.def("vector_add", &vector_add, py::arg("a"), py::arg("b"));
}
