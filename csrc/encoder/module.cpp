// bertctl._encoder: a BERT encoder's inference forward pass and pooling on one GPU, for `bertctl embed`,
// with no torch in the process (importing torch and starting its CUDA state took 2.1 s on an H200, this
// module's CUDA context and cuBLASLt 0.3 s).  Matrix products run in cuBLASLt with the bias in its
// epilogue; everything else is kernels.cu.  bertctl/native.py prepares the weights and the batches.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"

namespace py = pybind11;
using encoder::DType;

namespace {

void check(cudaError_t status, const char* what) {
    if (status == cudaSuccess) return;
    cudaGetLastError();  // clear it: the context stays usable after an allocation failure
    if (status == cudaErrorMemoryAllocation) throw std::bad_alloc();
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

void check(cublasStatus_t status, const char* what) {
    if (status != CUBLAS_STATUS_SUCCESS)
        throw std::runtime_error(std::string(what) + ": cuBLASLt status " + std::to_string(static_cast<int>(status)));
}

void launched(const char* what) { check(cudaGetLastError(), what); }

cudaDataType_t cuda_type(DType dtype) {
    switch (dtype) {
        case DType::f32: return CUDA_R_32F;
        case DType::f16: return CUDA_R_16F;
        default: return CUDA_R_16BF;
    }
}

// Device memory that grows to the largest size asked of it.
class Buffer {
  public:
    Buffer() = default;
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    ~Buffer() {
        if (ptr_) cudaFree(ptr_);
    }
    void* reserve(size_t bytes) {
        if (bytes > bytes_) {
            if (ptr_) cudaFree(ptr_);
            ptr_ = nullptr;
            bytes_ = 0;
            check(cudaMalloc(&ptr_, bytes), "cudaMalloc");
            bytes_ = bytes;
        }
        return ptr_;
    }
    template <typename T> T* as() const { return static_cast<T*>(ptr_); }

  private:
    void* ptr_ = nullptr;
    size_t bytes_ = 0;
};

struct Layer {
    const void *qkv_weight, *qkv_bias, *attention_weight, *attention_bias, *ffn_in_weight, *ffn_in_bias,
        *ffn_out_weight, *ffn_out_bias;
    const float *attention_gamma, *attention_beta, *ffn_gamma, *ffn_beta;
};

class Encoder {
  public:
    Encoder(int device, const std::string& dtype, int layers, int hidden, int heads, int intermediate, float eps,
            const std::string& act, const py::dict& weights)
        : device_(device), layers_(layers), hidden_(hidden), heads_(heads), intermediate_(intermediate), eps_(eps) {
        dtype_ = dtype == "fp32" ? DType::f32 : dtype == "fp16" ? DType::f16 : dtype == "bf16" ? DType::bf16
                 : throw std::invalid_argument("dtype must be fp32, fp16 or bf16, not " + dtype);
        act_ = act == "gelu" ? encoder::Act::gelu : act == "gelu_tanh" ? encoder::Act::gelu_tanh
               : act == "relu" ? encoder::Act::relu : throw std::invalid_argument("unsupported activation " + act);
        if (hidden % heads || !encoder::attention_supported(hidden / heads))
            throw std::invalid_argument("head size " + std::to_string(hidden / heads) + " (must be 32, 64 or 128)");
        if (hidden > encoder::kMaxHidden)
            throw std::invalid_argument("hidden size " + std::to_string(hidden) + " (at most 1024)");
        check(cudaSetDevice(device_), "cudaSetDevice");
        check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
        check(cublasLtCreate(&lt_), "cublasLtCreate");
        workspace_bytes_ = 32 << 20;
        workspace_.reserve(workspace_bytes_);
        upload(weights);
    }

    ~Encoder() {
        if (lt_) cublasLtDestroy(lt_);
        if (stream_) cudaStreamDestroy(stream_);
    }

    // Pooled features of one packed batch: ids and positions (tokens,), cu_seqlens (sequences + 1,).
    // keep: the hidden states used (0 the embeddings' output, i layer i's), summed first when `sum`, else
    // side by side; modes: the poolings, side by side.  Returns (sequences, modes x [1 or keep] x hidden).
    py::array_t<float> features(py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids,
                                py::array_t<int32_t, py::array::c_style | py::array::forcecast> positions,
                                py::array_t<int32_t, py::array::c_style | py::array::forcecast> cu_seqlens,
                                int max_len, const std::vector<int>& keep, bool sum, const std::vector<int>& modes) {
        const int tokens = static_cast<int>(ids.size());
        const int sequences = static_cast<int>(cu_seqlens.size()) - 1;
        if (positions.size() != tokens || sequences < 1 || keep.empty() || modes.empty())
            throw std::invalid_argument("features: inconsistent batch");
        int deepest = 0;
        for (int k : keep) {
            if (k < 0 || k > layers_) throw std::invalid_argument("features: no hidden state " + std::to_string(k));
            deepest = std::max(deepest, k);
        }
        const int groups = sum ? 1 : static_cast<int>(keep.size());
        const int stride = static_cast<int>(modes.size()) * groups * hidden_;
        py::array_t<float> result({sequences, stride});
        const int32_t* host_ids = ids.data();
        const int32_t* host_positions = positions.data();
        const int32_t* host_cu = cu_seqlens.data();
        float* host_out = result.mutable_data();
        {
            py::gil_scoped_release release;
            check(cudaSetDevice(device_), "cudaSetDevice");
            run(host_ids, host_positions, host_cu, tokens, sequences, max_len, keep, sum, modes, deepest, stride,
                host_out);
        }
        return result;
    }

  private:
    void upload(const py::dict& weights) {
        const size_t es = encoder::element_size(dtype_);
        auto want = [&](const std::string& name, size_t count, bool is_float) -> py::array {
            if (!weights.contains(name)) throw std::invalid_argument("missing weight " + name);
            py::array a = weights[name.c_str()].cast<py::array>();
            const size_t item = is_float ? 4 : es;
            if (static_cast<size_t>(a.size()) != count || static_cast<size_t>(a.itemsize()) != item ||
                !(a.flags() & py::array::c_style))
                throw std::invalid_argument("weight " + name + ": " + std::to_string(a.size()) + " elements of " +
                                            std::to_string(a.itemsize()) + " bytes, want " + std::to_string(count) +
                                            " of " + std::to_string(item));
            return a;
        };
        // One allocation, every tensor 256-byte aligned (cuBLASLt's fast kernels want 16).
        std::vector<std::pair<py::array, size_t>> parts;
        size_t total = 0;
        auto place = [&](const std::string& name, size_t count, bool is_float) -> size_t {
            py::array a = want(name, count, is_float);
            const size_t offset = total;
            total += (a.nbytes() + 255) / 256 * 256;
            parts.emplace_back(a, offset);
            return offset;
        };
        const size_t h = hidden_, i = intermediate_;
        const py::array word = weights["word"].cast<py::array>();
        const py::array position = weights["position"].cast<py::array>();
        vocab_ = static_cast<int>(word.size() / hidden_);
        positions_ = static_cast<int>(position.size() / hidden_);
        const size_t o_word = place("word", static_cast<size_t>(vocab_) * h, false);
        const size_t o_position = place("position", static_cast<size_t>(positions_) * h, false);
        const size_t o_type = place("type", h, false);
        const size_t o_gamma = place("embeddings.gamma", h, true), o_beta = place("embeddings.beta", h, true);
        struct Offsets { size_t v[12]; };
        std::vector<Offsets> offsets(layers_);
        for (int l = 0; l < layers_; ++l) {
            const std::string p = std::to_string(l) + ".";
            size_t* o = offsets[l].v;
            o[0] = place(p + "qkv.weight", 3 * h * h, false);
            o[1] = place(p + "qkv.bias", 3 * h, false);
            o[2] = place(p + "attention.weight", h * h, false);
            o[3] = place(p + "attention.bias", h, false);
            o[4] = place(p + "ffn_in.weight", i * h, false);
            o[5] = place(p + "ffn_in.bias", i, false);
            o[6] = place(p + "ffn_out.weight", h * i, false);
            o[7] = place(p + "ffn_out.bias", h, false);
            o[8] = place(p + "attention.gamma", h, true);
            o[9] = place(p + "attention.beta", h, true);
            o[10] = place(p + "ffn.gamma", h, true);
            o[11] = place(p + "ffn.beta", h, true);
        }
        char* base = static_cast<char*>(weights_.reserve(total));
        for (auto& [a, offset] : parts)
            check(cudaMemcpyAsync(base + offset, a.data(), a.nbytes(), cudaMemcpyHostToDevice, stream_), "upload");
        check(cudaStreamSynchronize(stream_), "upload");
        word_ = base + o_word;
        position_ = base + o_position;
        type_ = base + o_type;
        gamma_ = reinterpret_cast<const float*>(base + o_gamma);
        beta_ = reinterpret_cast<const float*>(base + o_beta);
        for (int l = 0; l < layers_; ++l) {
            const size_t* o = offsets[l].v;
            layer_.push_back(Layer{base + o[0], base + o[1], base + o[2], base + o[3], base + o[4], base + o[5],
                                   base + o[6], base + o[7], reinterpret_cast<const float*>(base + o[8]),
                                   reinterpret_cast<const float*>(base + o[9]),
                                   reinterpret_cast<const float*>(base + o[10]),
                                   reinterpret_cast<const float*>(base + o[11])});
        }
    }

    // y (tokens, n) = x (tokens, k) w (n, k)^T + bias, row-major; to cuBLASLt's column-major that is
    // y^T (n, tokens) = w^T(k, n)^T x^T (k, tokens).
    void linear(const void* x, const void* w, const void* bias, void* y, int tokens, int n, int k) {
        const cudaDataType_t type = cuda_type(dtype_);
        cublasLtMatmulDesc_t op = nullptr;
        cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
        cublasLtMatmulPreference_t preference = nullptr;
        auto release = [&] {
            if (preference) cublasLtMatmulPreferenceDestroy(preference);
            if (c) cublasLtMatrixLayoutDestroy(c);
            if (b) cublasLtMatrixLayoutDestroy(b);
            if (a) cublasLtMatrixLayoutDestroy(a);
            if (op) cublasLtMatmulDescDestroy(op);
        };
        try {
            check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor");
            const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
            check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)), "transa");
            check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep)), "transb");
            const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
            check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)), "epilogue");
            check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)), "bias");
            check(cublasLtMatrixLayoutCreate(&a, type, k, n, k), "layout a");
            check(cublasLtMatrixLayoutCreate(&b, type, k, tokens, k), "layout b");
            check(cublasLtMatrixLayoutCreate(&c, type, n, tokens, n), "layout c");
            check(cublasLtMatmulPreferenceCreate(&preference), "preference");
            check(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                       &workspace_bytes_, sizeof(workspace_bytes_)), "workspace");
            cublasLtMatmulHeuristicResult_t found{};
            int count = 0;
            check(cublasLtMatmulAlgoGetHeuristic(lt_, op, a, b, c, c, preference, 1, &found, &count), "heuristic");
            if (count == 0) throw std::runtime_error("cuBLASLt has no algorithm for this product");
            const float one = 1.f, zero = 0.f;
            check(cublasLtMatmul(lt_, op, &one, w, a, x, b, &zero, y, c, y, c, &found.algo, workspace_.as<void>(),
                                 workspace_bytes_, stream_), "matmul");
        } catch (...) {
            release();
            throw;
        }
        release();
    }

    void run(const int32_t* ids, const int32_t* positions, const int32_t* cu, int tokens, int sequences, int max_len,
             const std::vector<int>& keep, bool sum, const std::vector<int>& modes, int deepest, int stride,
             float* out) {
        const size_t es = encoder::element_size(dtype_);
        const size_t t = tokens, h = hidden_;
        int32_t* ints = static_cast<int32_t*>(ints_.reserve((2 * t + sequences + 1) * sizeof(int32_t)));
        void* hidden = hidden_buffer_.reserve(t * h * es);
        void* qkv = qkv_.reserve(t * 3 * h * es);
        void* context = context_.reserve(t * h * es);
        void* ffn = ffn_.reserve(t * intermediate_ * es);
        float* total = sum ? static_cast<float*>(sum_.reserve(t * h * sizeof(float))) : nullptr;
        float* pooled = static_cast<float*>(pooled_.reserve(static_cast<size_t>(sequences) * stride * sizeof(float)));
        check(cudaMemcpyAsync(ints, ids, t * sizeof(int32_t), cudaMemcpyHostToDevice, stream_), "ids");
        check(cudaMemcpyAsync(ints + t, positions, t * sizeof(int32_t), cudaMemcpyHostToDevice, stream_), "positions");
        check(cudaMemcpyAsync(ints + 2 * t, cu, (sequences + 1) * sizeof(int32_t), cudaMemcpyHostToDevice, stream_),
              "cu_seqlens");
        const int32_t* d_cu = ints + 2 * t;

        const int group_width = static_cast<int>(h);
        const int mode_width = (sum ? 1 : static_cast<int>(keep.size())) * group_width;
        bool first = true;
        auto take = [&](int state) {
            for (size_t k = 0; k < keep.size(); ++k) {
                if (keep[k] != state) continue;
                if (sum) {
                    encoder::accumulate(dtype_, hidden, total, static_cast<int64_t>(t * h), first, stream_);
                    first = false;
                    launched("accumulate");
                } else {
                    for (size_t m = 0; m < modes.size(); ++m) {
                        encoder::pool(dtype_, hidden, d_cu, pooled, sequences, hidden_, stride,
                                      static_cast<int>(m) * mode_width + static_cast<int>(k) * group_width,
                                      static_cast<encoder::Pool>(modes[m]), stream_);
                        launched("pool");
                    }
                }
            }
        };

        encoder::embed_layer_norm(dtype_, ints, ints + t, word_, position_, type_, gamma_, beta_, hidden, tokens,
                                  hidden_, eps_, stream_);
        launched("embeddings");
        take(0);
        for (int l = 0; l < deepest; ++l) {
            const Layer& w = layer_[l];
            linear(hidden, w.qkv_weight, w.qkv_bias, qkv, tokens, 3 * hidden_, hidden_);
            encoder::attention(dtype_, qkv, d_cu, context, sequences, max_len, heads_, hidden_ / heads_, stream_);
            launched("attention");
            linear(context, w.attention_weight, w.attention_bias, qkv, tokens, hidden_, hidden_);
            encoder::add_layer_norm(dtype_, qkv, hidden, w.attention_gamma, w.attention_beta, tokens, hidden_, eps_,
                                    stream_);
            launched("layer norm");
            linear(hidden, w.ffn_in_weight, w.ffn_in_bias, ffn, tokens, intermediate_, hidden_);
            encoder::activation(dtype_, act_, ffn, static_cast<int64_t>(t) * intermediate_, stream_);
            launched("activation");
            linear(ffn, w.ffn_out_weight, w.ffn_out_bias, qkv, tokens, hidden_, intermediate_);
            encoder::add_layer_norm(dtype_, qkv, hidden, w.ffn_gamma, w.ffn_beta, tokens, hidden_, eps_, stream_);
            launched("layer norm");
            take(l + 1);
        }
        if (sum) {
            for (size_t m = 0; m < modes.size(); ++m) {
                encoder::pool(DType::f32, total, d_cu, pooled, sequences, hidden_, stride,
                              static_cast<int>(m) * mode_width, static_cast<encoder::Pool>(modes[m]), stream_);
                launched("pool");
            }
        }
        check(cudaMemcpyAsync(out, pooled, static_cast<size_t>(sequences) * stride * sizeof(float),
                              cudaMemcpyDeviceToHost, stream_), "features");
        check(cudaStreamSynchronize(stream_), "forward pass");
    }

    int device_, layers_, hidden_, heads_, intermediate_;
    float eps_;
    DType dtype_;
    encoder::Act act_;
    int vocab_ = 0, positions_ = 0;
    cudaStream_t stream_ = nullptr;
    cublasLtHandle_t lt_ = nullptr;
    size_t workspace_bytes_ = 0;
    Buffer weights_, workspace_, ints_, hidden_buffer_, qkv_, context_, ffn_, sum_, pooled_;
    const void *word_ = nullptr, *position_ = nullptr, *type_ = nullptr;
    const float *gamma_ = nullptr, *beta_ = nullptr;
    std::vector<Layer> layer_;

  public:
    int vocab() const { return vocab_; }
    int max_positions() const { return positions_; }
};

int device_count() {
    int count = 0;
    const cudaError_t status = cudaGetDeviceCount(&count);
    if (status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver) {
        cudaGetLastError();
        return 0;
    }
    check(status, "cudaGetDeviceCount");
    return count;
}

std::string device_name(int device) {
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    return prop.name;
}

}  // namespace

PYBIND11_MODULE(_encoder, m) {
    m.doc() = "A BERT encoder's inference forward pass and pooling on one GPU, without torch (bertctl/native.py).";
    m.def("device_count", &device_count, "CUDA devices visible (0 without a driver or a device).");
    m.def("device_name", &device_name, py::arg("device"));
    py::class_<Encoder>(m, "Encoder")
        .def(py::init<int, const std::string&, int, int, int, int, float, const std::string&, const py::dict&>(),
             py::arg("device"), py::arg("dtype"), py::arg("layers"), py::arg("hidden"), py::arg("heads"),
             py::arg("intermediate"), py::arg("eps"), py::arg("act"), py::arg("weights"))
        .def("features", &Encoder::features, py::arg("ids"), py::arg("positions"), py::arg("cu_seqlens"),
             py::arg("max_len"), py::arg("keep"), py::arg("sum"), py::arg("modes"))
        .def_property_readonly("vocab", &Encoder::vocab)
        .def_property_readonly("max_positions", &Encoder::max_positions);
}
