// bertctl._encoder: a BERT encoder's inference forward pass and pooling on one GPU, for `bertctl embed`,
// with no torch in the process (importing torch and starting its CUDA state is most of a short embed
// run: benchmarks/results/embed-startup-h200-3133cda.json).  Matrix products run in cuBLASLt with the
// bias in its epilogue; everything else is kernels.cu.  The Python side of embed's native backend
// prepares the weights and the batches.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <map>
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

    // A whole job, queued on the GPU at once with one wait at its end: sequences of `lengths` tokens,
    // their ids packed in that order and cut into batches at `batch_ends` (sequence counts); sequence i's
    // features go to out[rows[i]].  keep: the hidden states used (0 the embeddings' output, i layer i's),
    // summed first when `sum`, else side by side; modes: the poolings, side by side, so that out is
    // (rows, modes x [1 or keep] x hidden); `normalize` divides each row by its L2 norm.
    void embed(py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids,
               py::array_t<int32_t, py::array::c_style | py::array::forcecast> lengths,
               py::array_t<int32_t, py::array::c_style | py::array::forcecast> rows,
               py::array_t<int32_t, py::array::c_style | py::array::forcecast> batch_ends, py::array_t<float> out,
               const std::vector<int>& keep, bool sum, const std::vector<int>& modes, bool normalize) {
        const int64_t tokens = ids.size(), sequences = lengths.size(), batches = batch_ends.size();
        const int groups = sum ? 1 : static_cast<int>(keep.size());
        const int stride = static_cast<int>(modes.size()) * groups * hidden_;
        if (keep.empty() || modes.empty()) throw std::invalid_argument("embed: no hidden states or no pooling");
        int deepest = 0;
        for (int k : keep) {
            if (k < 0 || k > layers_) throw std::invalid_argument("embed: no hidden state " + std::to_string(k));
            deepest = std::max(deepest, k);
        }
        for (int m : modes)
            if (m < 0 || m > static_cast<int>(encoder::Pool::last)) throw std::invalid_argument("embed: unknown pooling");
        if (out.ndim() != 2 || out.shape(1) != stride || !(out.flags() & py::array::c_style) || !out.writeable())
            throw std::invalid_argument("embed: out must be a writable C-contiguous (rows, " + std::to_string(stride) +
                                        ") float32 array");
        if (rows.size() != sequences || sequences == 0 || batches == 0)
            throw std::invalid_argument("embed: rows, lengths and batches disagree");
        const int64_t out_rows = out.shape(0);
        const int32_t* length = lengths.data();
        const int32_t* row = rows.data();
        const int32_t* end = batch_ends.data();
        // Host side: each token's position, each batch's cu_seqlens (from 0), sizes; checked before the GPU.
        std::vector<int32_t> positions(tokens), cu(sequences + batches);
        std::vector<int64_t> first_token(batches + 1, 0);
        std::vector<int> max_len(batches, 0);
        int64_t t = 0, s = 0, largest = 0;
        for (int64_t b = 0; b < batches; ++b) {
            if (end[b] <= s || end[b] > sequences) throw std::invalid_argument("embed: batch_ends must rise to len(lengths)");
            const int64_t batch_start = t;
            cu[s + b] = 0;
            for (; s < end[b]; ++s) {
                if (length[s] < 1 || length[s] > max_positions()) throw std::invalid_argument("embed: a length out of range");
                if (row[s] < 0 || row[s] >= out_rows) throw std::invalid_argument("embed: a row out of range");
                if (t + length[s] > tokens) throw std::invalid_argument("embed: more lengths than ids");
                for (int32_t p = 0; p < length[s]; ++p) positions[t++] = p;
                cu[s + b + 1] = static_cast<int32_t>(t - batch_start);
                max_len[b] = std::max(max_len[b], static_cast<int>(length[s]));
            }
            first_token[b + 1] = t;
            largest = std::max(largest, t - batch_start);
        }
        if (s != sequences || t != tokens) throw std::invalid_argument("embed: lengths do not add up to the ids");
        const int32_t* host_ids = ids.data();
        for (int64_t i = 0; i < tokens; ++i)
            if (host_ids[i] < 0 || host_ids[i] >= vocab_) throw std::invalid_argument("embed: a token id past the vocabulary");
        float* host_out = out.mutable_data();
        py::gil_scoped_release release;
        check(cudaSetDevice(device_), "cudaSetDevice");
        int32_t* ints = static_cast<int32_t*>(ints_.reserve((2 * tokens + 2 * sequences + batches) * sizeof(int32_t)));
        int32_t *d_ids = ints, *d_positions = ints + tokens, *d_cu = ints + 2 * tokens,
                *d_rows = ints + 2 * tokens + sequences + batches;
        check(cudaMemcpyAsync(d_ids, host_ids, tokens * sizeof(int32_t), cudaMemcpyHostToDevice, stream_), "ids");
        check(cudaMemcpyAsync(d_positions, positions.data(), tokens * sizeof(int32_t), cudaMemcpyHostToDevice, stream_),
              "positions");
        check(cudaMemcpyAsync(d_cu, cu.data(), cu.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_), "cu_seqlens");
        check(cudaMemcpyAsync(d_rows, row, sequences * sizeof(int32_t), cudaMemcpyHostToDevice, stream_), "rows");
        float* pooled = static_cast<float*>(pooled_.reserve(out_rows * stride * sizeof(float)));
        reserve(largest, sum);
        int64_t first_sequence = 0;
        for (int64_t b = 0; b < batches; ++b) {
            const int64_t n = end[b] - first_sequence;
            forward(d_ids + first_token[b], d_positions + first_token[b], d_cu + first_sequence + b,
                    d_rows + first_sequence, static_cast<int>(first_token[b + 1] - first_token[b]), static_cast<int>(n),
                    max_len[b], keep, sum, modes, deepest, stride, pooled);
            first_sequence = end[b];
        }
        if (normalize) {
            encoder::normalize(pooled, out_rows, stride, stream_);
            launched("normalize");
        }
        check(cudaMemcpyAsync(host_out, pooled, out_rows * stride * sizeof(float), cudaMemcpyDeviceToHost, stream_),
              "features");
        check(cudaStreamSynchronize(stream_), "forward pass");
    }

  private:
    // weights: name -> a list of arrays (float32, float16, or bfloat16 bits as uint16), concatenated;
    // they are copied as they are (from a memory-mapped file, say) and converted here on the GPU.
    void upload(const py::dict& weights) {
        struct Source {
            py::array array;
            DType type;
            size_t staged;  // byte offset in the staging buffer
        };
        struct Destination {
            std::vector<Source> sources;
            DType type;
            size_t offset;  // byte offset in weights_
        };
        std::vector<Destination> destinations;
        size_t total = 0, staging = 0;
        auto aligned = [](size_t bytes) { return (bytes + 255) / 256 * 256; };  // cuBLASLt's fast kernels want 16
        auto place = [&](const std::string& name, size_t count, bool is_float) -> size_t {
            if (!weights.contains(name)) throw std::invalid_argument("missing weight " + name);
            Destination d{{}, is_float ? DType::f32 : dtype_, total};
            size_t elements = 0;
            for (py::handle item : weights[name.c_str()].cast<py::list>()) {
                py::array a = py::reinterpret_borrow<py::array>(item);
                if (!(a.flags() & py::array::c_style)) throw std::invalid_argument("weight " + name + ": not contiguous");
                DType type;
                if (a.dtype().kind() == 'f' && a.itemsize() == 4) type = DType::f32;
                else if (a.dtype().kind() == 'f' && a.itemsize() == 2) type = DType::f16;
                else if (a.dtype().kind() == 'u' && a.itemsize() == 2) type = DType::bf16;
                else throw std::invalid_argument("weight " + name + ": float32, float16 or bfloat16 bits (uint16) only");
                d.sources.push_back(Source{a, type, staging});
                staging += aligned(a.nbytes());
                elements += a.size();
            }
            if (elements != count)
                throw std::invalid_argument("weight " + name + ": " + std::to_string(elements) + " elements, want " +
                                            std::to_string(count));
            total += aligned(count * encoder::element_size(d.type));
            destinations.push_back(std::move(d));
            return destinations.back().offset;
        };
        const size_t h = hidden_, i = intermediate_;
        auto rows = [&](const char* name) {
            size_t n = 0;
            for (py::handle item : weights[name].cast<py::list>()) n += py::reinterpret_borrow<py::array>(item).size();
            return static_cast<int>(n / h);
        };
        vocab_ = rows("word");
        positions_ = rows("position");
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
        {
            Buffer staged;
            char* stage = static_cast<char*>(staged.reserve(staging));
            for (const Destination& d : destinations) {
                size_t done = 0;  // elements of d written
                for (const Source& src : d.sources) {
                    check(cudaMemcpyAsync(stage + src.staged, src.array.data(), src.array.nbytes(),
                                          cudaMemcpyHostToDevice, stream_), "upload");
                    encoder::convert(src.type, stage + src.staged, d.type,
                                     base + d.offset + done * encoder::element_size(d.type), src.array.size(), stream_);
                    launched("convert");
                    done += src.array.size();
                }
            }
            check(cudaStreamSynchronize(stream_), "upload");
        }
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
            // The heuristic's answer, once a shape: asking it takes longer than the product itself.
            const std::array<int, 3> shape{tokens, n, k};
            auto known = algorithms_.find(shape);
            if (known == algorithms_.end()) {
                cublasLtMatmulHeuristicResult_t found{};
                int count = 0;
                check(cublasLtMatmulAlgoGetHeuristic(lt_, op, a, b, c, c, preference, 1, &found, &count), "heuristic");
                if (count == 0) throw std::runtime_error("cuBLASLt has no algorithm for this product");
                known = algorithms_.emplace(shape, found.algo).first;
            }
            const float one = 1.f, zero = 0.f;
            check(cublasLtMatmul(lt_, op, &one, w, a, x, b, &zero, y, c, y, c, &known->second, workspace_.as<void>(),
                                 workspace_bytes_, stream_), "matmul");
        } catch (...) {
            release();
            throw;
        }
        release();
    }

    // The activations of a batch of `tokens` tokens (buffers grow, never shrink: a wait each time).
    void reserve(int64_t tokens, bool sum) {
        const size_t es = encoder::element_size(dtype_), t = tokens, h = hidden_;
        hidden_buffer_.reserve(t * h * es);
        qkv_.reserve(t * 3 * h * es);
        context_.reserve(t * h * es);
        ffn_.reserve(t * intermediate_ * es);
        if (sum) sum_.reserve(t * h * sizeof(float));
    }

    // One batch, queued: the layers up to `deepest`, the pooled features into pooled's rows.
    void forward(const int32_t* ids, const int32_t* positions, const int32_t* cu, const int32_t* rows, int tokens,
                 int sequences, int max_len, const std::vector<int>& keep, bool sum, const std::vector<int>& modes,
                 int deepest, int stride, float* pooled) {
        const size_t t = tokens, h = hidden_;
        void* hidden = hidden_buffer_.as<void>();
        void* qkv = qkv_.as<void>();
        void* context = context_.as<void>();
        void* ffn = ffn_.as<void>();
        float* total = sum_.as<float>();
        const int group_width = hidden_;
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
                        encoder::pool(dtype_, hidden, cu, rows, pooled, sequences, hidden_, stride,
                                      static_cast<int>(m) * mode_width + static_cast<int>(k) * group_width,
                                      static_cast<encoder::Pool>(modes[m]), stream_);
                        launched("pool");
                    }
                }
            }
        };

        encoder::embed_layer_norm(dtype_, ids, positions, word_, position_, type_, gamma_, beta_, hidden, tokens,
                                  hidden_, eps_, stream_);
        launched("embeddings");
        take(0);
        for (int l = 0; l < deepest; ++l) {
            const Layer& w = layer_[l];
            linear(hidden, w.qkv_weight, w.qkv_bias, qkv, tokens, 3 * hidden_, hidden_);
            encoder::attention(dtype_, qkv, cu, context, sequences, max_len, heads_, hidden_ / heads_, stream_);
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
                encoder::pool(DType::f32, total, cu, rows, pooled, sequences, hidden_, stride,
                              static_cast<int>(m) * mode_width, static_cast<encoder::Pool>(modes[m]), stream_);
                launched("pool");
            }
        }
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
    std::map<std::array<int, 3>, cublasLtMatmulAlgo_t> algorithms_;  // (tokens, n, k) -> the heuristic's first

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

// The device's CUDA context, started (the runtime's primary context, which an Encoder then uses): it
// takes a tenth of a second or more, which the caller may spend reading the weights meanwhile.
void start_device(int device) {
    check(cudaSetDevice(device), "cudaSetDevice");
    check(cudaFree(nullptr), "starting the CUDA context");
}

std::string device_name(int device) {
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    return prop.name;
}

}  // namespace

PYBIND11_MODULE(_encoder, m) {
    m.doc() = "A BERT encoder's inference forward pass and pooling on one GPU, without torch (bertctl/inference/backends/native.py).";
    m.def("device_count", &device_count, "CUDA devices visible (0 without a driver or a device).");
    m.def("device_name", &device_name, py::arg("device"));
    m.def("start_device", &start_device, py::arg("device"), py::call_guard<py::gil_scoped_release>(),
          "Start the device's CUDA context (the GIL released meanwhile).");
    py::class_<Encoder>(m, "Encoder")
        .def(py::init<int, const std::string&, int, int, int, int, float, const std::string&, const py::dict&>(),
             py::arg("device"), py::arg("dtype"), py::arg("layers"), py::arg("hidden"), py::arg("heads"),
             py::arg("intermediate"), py::arg("eps"), py::arg("act"), py::arg("weights"))
        .def("embed", &Encoder::embed, py::arg("ids"), py::arg("lengths"), py::arg("rows"), py::arg("batch_ends"),
             py::arg("out"), py::arg("keep"), py::arg("sum"), py::arg("modes"), py::arg("normalize"))
        .def_property_readonly("vocab", &Encoder::vocab)
        .def_property_readonly("max_positions", &Encoder::max_positions);
}
