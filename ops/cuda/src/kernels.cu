// The CUDA kernels of legion-cuda: every primitive that is not a cuDNN convolution or a cuBLAS
// GEMM. Compiled at run time by NVRTC (see kernels.rs) with --fmad=false and no fast math, so that
// each expression rounds exactly like the CPU kernels in legion-ops/src/kernels (Rust never fuses
// a multiply and an add). Where a result can still differ from the CPU in the last bits, the
// kernel says so: expf/logf (CUDA's are within 2 ulp, Rust's follow the C library) and sums whose
// order differs (f64 reductions, here in a tree).
//
// Conventions, as on the CPU: a buffer is row-major over a rect in GLOBAL tensor coordinates. A
// rect reaches the kernels as a Box4 of four axes; rects of fewer axes are padded with trailing
// axes [0, 1) (legion_ops::shape::Rect stores them that way), so channel is always axis 1.
// Outputs are laid out over exactly the region a kernel writes, so output element i is point i of
// that region; inputs may be laid out over larger rects and are addressed by global point.

typedef long long i64;
typedef unsigned long long u64;

struct Box4 {
    i64 lo[4];
    i64 ext[4];
};

#define GRID_STRIDE(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// -inf without math.h (NVRTC has no standard headers).
#define NEG_INF __int_as_float(0xff800000)

// ---------------------------------------------------------------------------------------------
// Element types. Activations and their gradients are stored as float, or as bf16 in a bf16 run
// (legion_ops::precision): the upper half of a float's bits, as cuDNN and cuBLAS read
// CUDNN_DATA_BFLOAT16 and CUDA_R_16BF. Kernels templated on the storage type T load each element
// to float, compute in float exactly as before, and store through from_f32<T>; for T = float both
// are the identity, so fp32 results are bit for bit those of the untemplated kernels. The
// conversions are written from bit operations (no cuda_bf16.h), so that the host emulation
// compiles and checks them too.

struct bf16 {
    unsigned short bits;
};

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16 v) { return __uint_as_float((unsigned)v.bits << 16); }

// Round to nearest, ties to even: add half a bf16 ulp (less one when the kept half is even) and
// keep the upper half; a carry out of the mantissa moves to the next binade, and past the largest
// finite value to infinity, as IEEE rounding does. A NaN keeps its sign and upper payload with
// the quiet bit set, so that no NaN rounds to infinity (legion_ops::precision::bf16_bits).
__device__ __forceinline__ bf16 bf16_of(float v) {
    unsigned bits = __float_as_uint(v);
    bf16 out;
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        out.bits = (unsigned short)((bits >> 16) | 0x0040u);
        return out;
    }
    out.bits = (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    return out;
}

template <class T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float v) { return bf16_of(v); }

// dst += src in the buffer's own type: exact types add as themselves (f64 sums stay f64); bf16
// adds in float and rounds once.
__device__ __forceinline__ void add_into(float& dst, float src) { dst += src; }
__device__ __forceinline__ void add_into(double& dst, double src) { dst += src; }
__device__ __forceinline__ void add_into(bf16& dst, bf16 src) {
    dst = bf16_of(to_f32(dst) + to_f32(src));
}

// Threads of a warp. A macro, so that a host emulation (one thread at a time) can set it to 1,
// which leaves every warp loop and shuffle a no-op.
#ifndef WARP
#define WARP 32
#endif

// The threads of every reduction block; the host launches the reductions with exactly this many.
#define REDUCE_THREADS 256

// Global point of element i of a row-major region. In 32 bits where the index and the extents fit
// (all but the largest tensors): a 64-bit division is a long software routine on a GPU, a 32-bit
// one a few instructions, and every kernel that locates elements does four of each.
__device__ __forceinline__ void point_of(const Box4& region, i64 i, i64 p[4]) {
    u64 widest = (u64)i | (u64)region.ext[0] | (u64)region.ext[1] | (u64)region.ext[2] |
                 (u64)region.ext[3];
    if (widest <= 0xffffffffull) {
        unsigned u = (unsigned)i;
        for (int a = 3; a >= 0; --a) {
            unsigned e = (unsigned)region.ext[a];
            p[a] = region.lo[a] + (i64)(u % e);
            u /= e;
        }
        return;
    }
    for (int a = 3; a >= 0; --a) {
        p[a] = region.lo[a] + i % region.ext[a];
        i /= region.ext[a];
    }
}

// Row-major offset of global point p in a buffer laid out over `layout`.
__device__ __forceinline__ i64 offset_in(const Box4& layout, const i64 p[4]) {
    i64 off = 0;
    for (int a = 0; a < 4; ++a) off = off * layout.ext[a] + (p[a] - layout.lo[a]);
    return off;
}

// Offset in `layout` of element i of `region`; `packed` says the host found every operand of the
// launch laid out over exactly the region, where the offset is i itself.
__device__ __forceinline__ i64 at(const Box4& layout, const Box4& region, i64 i, int packed) {
    if (packed) return i;
    i64 p[4];
    point_of(region, i, p);
    return offset_in(layout, p);
}

// Sums a and b over the block (REDUCE_THREADS threads); the totals are valid in thread 0. The tree
// is fixed, so a launch is deterministic.
__device__ void block_sum2(double& a, double& b) {
    __shared__ double shared_a[REDUCE_THREADS / WARP];
    __shared__ double shared_b[REDUCE_THREADS / WARP];
    for (int offset = WARP / 2; offset > 0; offset /= 2) {
        a += __shfl_down_sync(0xffffffffu, a, offset);
        b += __shfl_down_sync(0xffffffffu, b, offset);
    }
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (lane == 0) {
        shared_a[warp] = a;
        shared_b[warp] = b;
    }
    __syncthreads();
    if (warp == 0) {
        a = lane < REDUCE_THREADS / WARP ? shared_a[lane] : 0.0;
        b = lane < REDUCE_THREADS / WARP ? shared_b[lane] : 0.0;
        for (int offset = WARP / 2; offset > 0; offset /= 2) {
            a += __shfl_down_sync(0xffffffffu, a, offset);
            b += __shfl_down_sync(0xffffffffu, b, offset);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Moves between buffers laid out over different rects (gathers, halos, folds, concat, images).

template <class T>
__device__ void copy_region(const T* src, Box4 src_layout, T* dst, Box4 dst_layout, Box4 region,
                            i64 n) {
    GRID_STRIDE(i, n) {
        i64 p[4];
        point_of(region, i, p);
        dst[offset_in(dst_layout, p)] = src[offset_in(src_layout, p)];
    }
}

template <class T>
__device__ void add_region(const T* src, Box4 src_layout, T* dst, Box4 dst_layout, Box4 region,
                           i64 n) {
    GRID_STRIDE(i, n) {
        i64 p[4];
        point_of(region, i, p);
        add_into(dst[offset_in(dst_layout, p)], src[offset_in(src_layout, p)]);
    }
}

// `dst[i] += src[i]` over n consecutive elements: a sum between regions that are one run in both
// layouts, with no index arithmetic.
template <class T> __device__ void add_runs(const T* src, T* dst, i64 n) {
    GRID_STRIDE(i, n) { add_into(dst[i], src[i]); }
}

// A fold with no terms over part of its instance: `dst[region] = 0` (all-zero bits in every type).
template <class T> __device__ void zero_region(T* dst, Box4 dst_layout, Box4 region, i64 n) {
    GRID_STRIDE(i, n) {
        i64 p[4];
        point_of(region, i, p);
        dst[offset_in(dst_layout, p)] = T();
    }
}

// Each region kernel once per element type, under the names kernels.rs loads.
#define REGION_KERNELS(T, suffix)                                                              \
    extern "C" __global__ void copy_region_##suffix(const T* src, Box4 src_layout, T* dst,    \
                                                    Box4 dst_layout, Box4 region, i64 n) {    \
        copy_region(src, src_layout, dst, dst_layout, region, n);                              \
    }                                                                                          \
    extern "C" __global__ void add_region_##suffix(const T* src, Box4 src_layout, T* dst,     \
                                                   Box4 dst_layout, Box4 region, i64 n) {     \
        add_region(src, src_layout, dst, dst_layout, region, n);                               \
    }                                                                                          \
    extern "C" __global__ void add_runs_##suffix(const T* src, T* dst, i64 n) {               \
        add_runs(src, dst, n);                                                                 \
    }                                                                                          \
    extern "C" __global__ void zero_region_##suffix(T* dst, Box4 dst_layout, Box4 region,     \
                                                    i64 n) {                                   \
        zero_region(dst, dst_layout, region, n);                                               \
    }
REGION_KERNELS(float, f32)
REGION_KERNELS(double, f64)
REGION_KERNELS(bf16, bf16)

// A weight's bf16 working copy from its f32 master, a batch's images as a bf16 run's first
// activation, and back (a weight gradient cuDNN computed in bf16, for the fp32 update).
extern "C" __global__ void cast_f32_bf16(const float* src, bf16* dst, i64 n) {
    GRID_STRIDE(i, n) { dst[i] = bf16_of(src[i]); }
}

extern "C" __global__ void cast_bf16_f32(const bf16* src, float* dst, i64 n) {
    GRID_STRIDE(i, n) { dst[i] = to_f32(src[i]); }
}

// ---------------------------------------------------------------------------------------------
// Element-wise ops over an output tile (the output laid out over the tile).

// NaN stays NaN (NaN < 0 is false), as on the CPU, so divergence is not hidden.
template <class T>
__device__ void relu_forward_t(const T* x, Box4 x_layout, T* y, Box4 tile, i64 n, int packed) {
    GRID_STRIDE(i, n) {
        float v = to_f32(x[at(x_layout, tile, i, packed)]);
        y[i] = from_f32<T>(v < 0.0f ? 0.0f : v);
    }
}

// dx = dy·[y > 0]; also the fused-ReLU mask of conv and dense backward.
template <class T>
__device__ void relu_backward_t(const T* y, Box4 y_layout, const T* dy, Box4 dy_layout, T* dx,
                              Box4 tile, i64 n, int packed) {
    GRID_STRIDE(i, n) {
        float yv = to_f32(y[at(y_layout, tile, i, packed)]);
        float g = to_f32(dy[at(dy_layout, tile, i, packed)]);
        dx[i] = from_f32<T>(yv > 0.0f ? g : 0.0f);
    }
}

// The element-wise unary ops (legion_ops's `Unary`), one line each: the op's name, y as a function
// of the input v and the op's attribute a (LeakyReLU's slope; 0 for an op without one), and dx as
// a function of r (what the gradient reads: the input or the output, as `Unary::grad_from` says),
// g, the output gradient, and a. The formulas are the CPU's, term for term, so that only the
// library functions can differ: expf and tanhf may differ from the CPU's exp and tanh in the last
// bit or two.
#define UNARY_OPS(X)                                                                           \
    X(sigmoid, 1.0f / (1.0f + expf(-v)), g * r * (1.0f - r))                                  \
    X(tanh, tanhf(v), g * (1.0f - r * r))                                                      \
    X(hardswish, v * fminf(fmaxf(v + 3.0f, 0.0f), 6.0f) / 6.0f,                                \
      r < -3.0f ? 0.0f : (r <= 3.0f ? g * (r / 3.0f + 0.5f) : g))                              \
    X(hardsigmoid, fminf(fmaxf(v + 3.0f, 0.0f), 6.0f) / 6.0f,                                  \
      (r > -3.0f && r < 3.0f) ? g / 6.0f : 0.0f)                                               \
    X(relu6, fminf(fmaxf(v, 0.0f), 6.0f), (r > 0.0f && r < 6.0f) ? g : 0.0f)                   \
    X(silu, v / (1.0f + expf(-v)),                                                             \
      g * (1.0f / (1.0f + expf(-r))) * (1.0f + r * (1.0f - 1.0f / (1.0f + expf(-r)))))         \
    X(leaky_relu, v > 0.0f ? v : a * v, r > 0.0f ? g : a * g)

#define UNARY_OP_TEMPLATES(name, forward, backward)                                            \
    template <class T>                                                                         \
    __device__ void name##_forward_t(const T* x, Box4 x_layout, T* y, Box4 tile, i64 n,        \
                                     int packed, float a) {                                    \
        GRID_STRIDE(i, n) {                                                                    \
            float v = to_f32(x[at(x_layout, tile, i, packed)]);                                \
            y[i] = from_f32<T>(forward);                                                       \
        }                                                                                      \
    }                                                                                          \
    template <class T>                                                                         \
    __device__ void name##_backward_t(const T* x, Box4 x_layout, const T* dy, Box4 dy_layout,  \
                                      T* dx, Box4 tile, i64 n, int packed, float a) {          \
        GRID_STRIDE(i, n) {                                                                    \
            float r = to_f32(x[at(x_layout, tile, i, packed)]);                                \
            float g = to_f32(dy[at(dy_layout, tile, i, packed)]);                              \
            dx[i] = from_f32<T>(backward);                                                     \
        }                                                                                      \
    }
UNARY_OPS(UNARY_OP_TEMPLATES)

template <class T>
__device__ void add_forward_t(const T* a, Box4 a_layout, const T* b, Box4 b_layout, T* y,
                            Box4 tile, i64 n, int packed) {
    GRID_STRIDE(i, n) {
        y[i] = from_f32<T>(to_f32(a[at(a_layout, tile, i, packed)]) +
                           to_f32(b[at(b_layout, tile, i, packed)]));
    }
}

// y = a · b, b of a's shape or a channel scale laid out over H = W = [0, 1) and broadcast over
// them (legion_ops's `Mul`; the CPU's `kernels::mul` tells a scale the same way). Also the
// factors' gradients: dy · b, and dy · a where the factors have one shape.
template <class T>
__device__ void mul_forward_t(const T* a, Box4 a_layout, const T* b, Box4 b_layout, T* y,
                              Box4 tile, i64 n, int packed) {
    int scale = b_layout.lo[2] == 0 && b_layout.ext[2] == 1 && b_layout.lo[3] == 0 &&
                b_layout.ext[3] == 1;
    GRID_STRIDE(i, n) {
        float u, v;
        if (packed) {
            u = to_f32(a[i]);
            v = to_f32(b[i]);
        } else {
            i64 p[4];
            point_of(tile, i, p);
            u = to_f32(a[offset_in(a_layout, p)]);
            if (scale) p[2] = p[3] = 0;
            v = to_f32(b[offset_in(b_layout, p)]);
        }
        y[i] = from_f32<T>(u * v);
    }
}

// A channel scale's gradient: ds[n, c] = Σ over the tile's rows and columns of dy · x, one block
// per element of ds (laid out over `region`, the tile's samples and channels at H = W = 0), the
// products summed in f64 as the CPU sums them (in another order: the last bits may differ).
template <class T>
__device__ void mul_scale_grad_t(const T* x, Box4 x_layout, const T* dy, Box4 dy_layout, T* ds,
                                 Box4 region, Box4 tile) {
    i64 p[4];
    point_of(region, blockIdx.x, p);
    i64 cols = tile.ext[3], m = tile.ext[2] * tile.ext[3];
    double sum = 0.0, unused = 0.0;
    for (i64 j = threadIdx.x; j < m; j += blockDim.x) {
        p[2] = tile.lo[2] + j / cols;
        p[3] = tile.lo[3] + j % cols;
        sum += (double)(to_f32(dy[offset_in(dy_layout, p)]) * to_f32(x[offset_in(x_layout, p)]));
    }
    block_sum2(sum, unused);
    if (threadIdx.x == 0) ds[blockIdx.x] = from_f32<T>((float)sum);
}

#define MUL_SCALE_GRAD_KERNEL(T, suffix)                                                      \
    extern "C" __global__ void mul_scale_grad##suffix(const T* x, Box4 x_layout, const T* dy, \
                                                      Box4 dy_layout, T* ds, Box4 region,     \
                                                      Box4 tile) {                            \
        mul_scale_grad_t(x, x_layout, dy, dy_layout, ds, region, tile);                       \
    }
MUL_SCALE_GRAD_KERNEL(float, )
MUL_SCALE_GRAD_KERNEL(bf16, _bf16)

// The unary (x → y) and binary (a, b → y) element-wise kernels once per activation type.
#define UNARY_KERNEL(name, T, suffix)                                                          \
    extern "C" __global__ void name##suffix(const T* x, Box4 x_layout, T* y, Box4 tile, i64 n, \
                                            int packed) {                                      \
        name##_t(x, x_layout, y, tile, n, packed);                                                 \
    }
#define BINARY_KERNEL(name, T, suffix)                                                         \
    extern "C" __global__ void name##suffix(const T* a, Box4 a_layout, const T* b,            \
                                            Box4 b_layout, T* y, Box4 tile, i64 n,             \
                                            int packed) {                                      \
        name##_t(a, a_layout, b, b_layout, y, tile, n, packed);                                    \
    }
#define ELEMENTWISE_KERNELS(T, suffix)          \
    UNARY_KERNEL(relu_forward, T, suffix)       \
    BINARY_KERNEL(relu_backward, T, suffix)     \
    BINARY_KERNEL(add_forward, T, suffix)       \
    BINARY_KERNEL(mul_forward, T, suffix)
ELEMENTWISE_KERNELS(float, )
ELEMENTWISE_KERNELS(bf16, _bf16)
// The unary family's kernels take the op's attribute last.
#define UNARY_OP_KERNEL(name, T, suffix)                                                       \
    extern "C" __global__ void name##suffix(const T* x, Box4 x_layout, T* y, Box4 tile, i64 n, \
                                            int packed, float a) {                             \
        name##_t(x, x_layout, y, tile, n, packed, a);                                          \
    }
#define UNARY_OP_GRAD_KERNEL(name, T, suffix)                                                  \
    extern "C" __global__ void name##suffix(const T* x, Box4 x_layout, const T* dy,           \
                                            Box4 dy_layout, T* dx, Box4 tile, i64 n,           \
                                            int packed, float a) {                             \
        name##_t(x, x_layout, dy, dy_layout, dx, tile, n, packed, a);                          \
    }
#define UNARY_OP_KERNELS_F32(name, forward, backward) \
    UNARY_OP_KERNEL(name##_forward, float, )          \
    UNARY_OP_GRAD_KERNEL(name##_backward, float, )
#define UNARY_OP_KERNELS_BF16(name, forward, backward) \
    UNARY_OP_KERNEL(name##_forward, bf16, _bf16)       \
    UNARY_OP_GRAD_KERNEL(name##_backward, bf16, _bf16)
UNARY_OPS(UNARY_OP_KERNELS_F32)
UNARY_OPS(UNARY_OP_KERNELS_BF16)

// ---------------------------------------------------------------------------------------------
// Walking one channel of a tile: the per-channel kernels (bias and activation, the bias
// gradient, batch norm) give each block one part of one channel's elements, in (sample, row,
// column) order: block b takes part b % parts of channel b / parts, and its threads every
// blockDim.x-th element of the part. A thread keeps its element's row and column as counters and
// each operand's offset as a running sum, so an element costs a few additions and no division
// (locating an element from its index took two to four divisions, more work than moving it).
// The host checks that a channel of a tile has fewer than 2^32 elements.

// This block's channel (local to the tile, and global) and its part's elements [lo, hi).
struct ChannelPart {
    i64 local, c, lo, hi;
};

__device__ __forceinline__ ChannelPart channel_part(const Box4& tile, i64 parts) {
    ChannelPart p;
    i64 per_channel = tile.ext[0] * tile.ext[2] * tile.ext[3];
    i64 part = blockIdx.x % parts;
    p.local = blockIdx.x / parts;
    p.c = tile.lo[1] + p.local;
    p.lo = per_channel * part / parts;
    p.hi = per_channel * (part + 1) / parts;
    return p;
}

// A thread's position in its channel: the row and column within the tile, and the stride
// (blockDim.x elements) as samples, rows and columns. `wrapped` says which counters the last step
// carried over: 1 the column (to the next row), 2 the row (to the next sample).
struct Walk {
    unsigned h, w, height, width, dn, dh, dw;
    int wrapped;
};

__device__ __forceinline__ Walk walk_from(const Box4& tile, i64 j, i64& n) {
    Walk k;
    // A tile without rows or columns has no element to walk: any nonzero extents will do.
    k.height = tile.ext[2] > 0 ? (unsigned)tile.ext[2] : 1u;
    k.width = tile.ext[3] > 0 ? (unsigned)tile.ext[3] : 1u;
    unsigned plane = k.height * k.width;
    unsigned jj = (unsigned)j, stride = blockDim.x;
    n = jj / plane;
    unsigned r = jj - (unsigned)n * plane;
    k.h = r / k.width;
    k.w = r - k.h * k.width;
    k.dn = stride / plane;
    r = stride - k.dn * plane;
    k.dh = r / k.width;
    k.dw = r - k.dh * k.width;
    k.wrapped = 0;
    return k;
}

__device__ __forceinline__ void walk_step(Walk& k) {
    k.w += k.dw;
    k.h += k.dh;
    k.wrapped = 0;
    if (k.w >= k.width) {
        k.w -= k.width;
        k.h += 1;
        k.wrapped = 1;
    }
    if (k.h >= k.height) {
        k.h -= k.height;
        k.wrapped |= 2;
    }
}

// One operand's offsets along a walk, in a buffer laid out over `layout`: the current element's,
// the stride's without carries, and what each carry adds.
struct Lane {
    i64 at, step, carry_w, carry_h;
};

__device__ __forceinline__ Lane lane_of(const Box4& layout, const Box4& tile, i64 c, i64 n,
                                        const Walk& k) {
    Lane l;
    i64 row = layout.ext[3];
    i64 sample = layout.ext[1] * layout.ext[2] * row;
    i64 p[4] = {tile.lo[0] + n, c, tile.lo[2] + (i64)k.h, tile.lo[3] + (i64)k.w};
    l.at = offset_in(layout, p);
    l.step = (i64)k.dn * sample + (i64)k.dh * row + (i64)k.dw;
    l.carry_w = row - (i64)k.width;
    l.carry_h = sample - (i64)k.height * row;
    return l;
}

__device__ __forceinline__ void lane_step(Lane& l, const Walk& k) {
    l.at += l.step;
    if (k.wrapped & 1) l.at += l.carry_w;
    if (k.wrapped & 2) l.at += l.carry_h;
}

// The channel (local to the tile) of element i of an [N, C] tile, one element per sample and
// channel: one 32-bit remainder where the index fits.
__device__ __forceinline__ i64 row_channel(i64 i, i64 channels) {
    return (i <= 0xffffffffLL && channels <= 0xffffffffLL) ? (i64)((unsigned)i % (unsigned)channels)
                                                           : i % channels;
}

// y = x + bias[c], then max(·, 0) when `relu`: the bias and fused activation after a cuBLAS or
// cuDNN product. `bias` (fp32, the master) may be null. In bf16 the product was already rounded
// to bf16 by the library; the sum is rounded once more (one extra rounding per output).
__device__ __forceinline__ float biased(float z, const float* bias, float b, int relu) {
    if (bias) z = z + b;
    return (relu && z < 0.0f) ? 0.0f : z;
}

template <class T>
__device__ void bias_activation_t(T* y, Box4 tile, const float* bias, i64 bias_lo, int relu,
                                  i64 parts) {
    ChannelPart part = channel_part(tile, parts);
    float b = bias ? bias[part.c - bias_lo] : 0.0f;
    i64 n;
    Walk k = walk_from(tile, part.lo + threadIdx.x, n);
    Lane at = lane_of(tile, tile, part.c, n, k);
    for (i64 j = part.lo + threadIdx.x; j < part.hi; j += blockDim.x) {
        y[at.at] = from_f32<T>(biased(to_f32(y[at.at]), bias, b, relu));
        walk_step(k);
        lane_step(at, k);
    }
}

// As bias_activation_t over a tile of one element per sample and channel (a dense layer's [N, C]
// output): consecutive threads take consecutive channels of a sample, so that their loads
// coalesce, where walking a channel would stride a whole row per element.
template <class T>
__device__ void bias_activation_rows_t(T* y, i64 c_lo, i64 channels, const float* bias,
                                       i64 bias_lo, int relu, i64 n) {
    GRID_STRIDE(i, n) {
        float b = bias ? bias[c_lo + row_channel(i, channels) - bias_lo] : 0.0f;
        y[i] = from_f32<T>(biased(to_f32(y[i]), bias, b, relu));
    }
}

// Per channel of `tile`, the sum over samples and positions of `dz` (laid out over the tile): the
// bias gradient. Each part's sum goes into partial[part][channel] (f64), and channel_sum_finish
// adds the parts in order and rounds to f32 (the gradient is fp32 in every precision). Summed in
// f64, so the result is closer to exact than the CPU's f32 sum and may differ from it in the last
// bits.
template <class T> __device__ void channel_sum_t(const T* dz, Box4 tile, i64 parts, double* partial) {
    ChannelPart part = channel_part(tile, parts);
    i64 n;
    Walk k = walk_from(tile, part.lo + threadIdx.x, n);
    Lane at = lane_of(tile, tile, part.c, n, k);
    double sum = 0.0, unused = 0.0;
    for (i64 j = part.lo + threadIdx.x; j < part.hi; j += blockDim.x) {
        sum += (double)to_f32(dz[at.at]);
        walk_step(k);
        lane_step(at, k);
    }
    block_sum2(sum, unused);
    if (threadIdx.x == 0) partial[(blockIdx.x % parts) * tile.ext[1] + part.local] = sum;
}

extern "C" __global__ void channel_sum_finish(const double* partial, i64 parts, i64 channels,
                                              i64 c_lo, float* out, i64 out_lo) {
    GRID_STRIDE(c, channels) {
        double sum = 0.0;
        for (i64 p = 0; p < parts; ++p) sum += partial[p * channels + c];
        out[c_lo + c - out_lo] = (float)sum;
    }
}

#define EPILOGUE_KERNELS(T, suffix)                                                            \
    extern "C" __global__ void bias_activation##suffix(T* y, Box4 tile, const float* bias,    \
                                                       i64 bias_lo, int relu, i64 parts) {     \
        bias_activation_t(y, tile, bias, bias_lo, relu, parts);                                \
    }                                                                                          \
    extern "C" __global__ void bias_activation_rows##suffix(                                   \
        T* y, i64 c_lo, i64 channels, const float* bias, i64 bias_lo, int relu, i64 n) {       \
        bias_activation_rows_t(y, c_lo, channels, bias, bias_lo, relu, n);                     \
    }                                                                                          \
    extern "C" __global__ void channel_sum##suffix(const T* dz, Box4 tile, i64 parts,         \
                                                   double* partial) {                          \
        channel_sum_t(dz, tile, parts, partial);                                               \
    }
EPILOGUE_KERNELS(float, )
EPILOGUE_KERNELS(bf16, _bf16)

// ---------------------------------------------------------------------------------------------
// Dropout: kept iff unit_f32(mix64(key ^ index)) >= rate, with key = hash(seed, step, salt) and
// index the element's flat row-major index in the FULL tensor (legion_ops::rng and
// kernels::dropout). The step is read from device memory, so that a recorded step replayed later
// draws the mask of the step it replays (crate::capture). Integer arithmetic and one exact float
// product: the mask is bit-identical to the CPU's.

__device__ __forceinline__ u64 mix64(u64 z) {
    z = z + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ float unit_f32(u64 h) {
    return (float)(h >> 40) * (1.0f / 16777216.0f);
}

// rng::hash of three words: folded left to right from the same initial value.
__device__ __forceinline__ u64 hash3(u64 a, u64 b, u64 c) {
    u64 h = 0x6A09E667F3BCC909ull;
    h = mix64(h ^ a);
    h = mix64(h ^ b);
    return mix64(h ^ c);
}

template <class T>
__device__ void dropout_apply_t(const T* x, Box4 x_layout, T* y, Box4 tile, Box4 full, u64 seed,
                              const u64* step, u64 salt, float rate, float scale, i64 n) {
    u64 key = hash3(seed, *step, salt);
    GRID_STRIDE(i, n) {
        i64 p[4];
        point_of(tile, i, p);
        u64 index = (u64)offset_in(full, p);
        float v = to_f32(x[offset_in(x_layout, p)]);
        y[i] = from_f32<T>(unit_f32(mix64(key ^ index)) >= rate ? v * scale : 0.0f);
    }
}

#define DROPOUT_KERNEL(T, suffix)                                                              \
    extern "C" __global__ void dropout_apply##suffix(const T* x, Box4 x_layout, T* y,         \
                                                     Box4 tile, Box4 full, u64 seed,           \
                                                     const u64* step, u64 salt, float rate,    \
                                                     float scale, i64 n) {                     \
        dropout_apply_t(x, x_layout, y, tile, full, seed, step, salt, rate, scale, n);           \
    }
DROPOUT_KERNEL(float, )
DROPOUT_KERNEL(bf16, _bf16)

// ---------------------------------------------------------------------------------------------
// Synthetic data drawn on the device (legion_ops::data::SyntheticBatch::render, value for value):
// pixel (s, c, y, x) is the sum over its channel's waves, in order from zero, of
// a[y]·cos[x] − b[y]·sin[x], plus noise_scale times the approximate normal value of its noise word
// mix64(state + (k + 1)·γ), k its index in the sample (CHW). Every operation rounds as Rust's do
// (no fused multiply-adds), so the images are bit-identical to the host's.

#define SYNTHETIC_WAVES 3

// The centred sum of the word's four 16-bit quarters, scaled to unit variance (Irwin–Hall, n = 4).
__device__ __forceinline__ float approx_standard_normal(u64 bits) {
    float sum = 0.0f;
    for (int k = 0; k < 4; ++k) sum += (float)((bits >> (16 * k)) & 0xffffull) * (1.0f / 65536.0f);
    return (sum - 2.0f) * sqrtf(3.0f);
}

extern "C" __global__ void synthetic_draw(float* out, const float* factors, const u64* states,
                                          float noise_scale, i64 samples, i64 channels,
                                          i64 height, i64 width) {
    i64 plane = height * width;
    i64 per_sample = channels * plane;
    i64 per_wave = 2 * (width + height);
    GRID_STRIDE(i, samples * per_sample) {
        i64 s = i / per_sample;
        i64 k = i - s * per_sample;
        i64 c = k / plane;
        i64 y = (k - c * plane) / width;
        i64 x = k - c * plane - y * width;
        const float* wave = factors + (s * channels + c) * SYNTHETIC_WAVES * per_wave;
        float p = 0.0f;
        for (int w = 0; w < SYNTHETIC_WAVES; ++w, wave += per_wave) {
            float a = wave[2 * width + y], b = wave[2 * width + height + y];
            p += a * wave[x] - b * wave[width + x];
        }
        u64 word = mix64(states[s] + (u64)(k + 1) * 0x9E3779B97F4A7C15ull);
        out[i] = p + noise_scale * approx_standard_normal(word);
    }
}

// Writes the step number kernels read on the device (one thread).
extern "C" __global__ void store_step(u64* at, u64 step) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *at = step;
}

// ---------------------------------------------------------------------------------------------
// 2-D pooling over an output tile: a sliding window (Pool2d) or adaptive average pooling's
// windows (AdaptiveAvgPool2d). Sliding windows are clipped to the input: max ignores padding,
// average counts it (divides by the window's extent in the padded input, kh·kw but where a
// ceil_mode window runs past the padding). Same window arithmetic as PoolWindows::window.

struct Pool {
    i64 kernel[2];
    i64 stride[2];
    i64 padding[2];
    i64 in_size[2];   // full input H, W
    i64 out_size[2];  // full output H, W (adaptive windows tile the input into them)
    int is_max;
    int adaptive;
};

// Output o's window along axis a, [lo, hi) of the input, and how many positions of the padded
// input it spans.
__device__ __forceinline__ void pool_window(const Pool& pool, int a, i64 o, i64& lo, i64& hi,
                                            i64& padded_len) {
    i64 size = pool.in_size[a];
    if (pool.adaptive) {
        i64 out = pool.out_size[a];
        lo = o * size / out;
        hi = ((o + 1) * size + out - 1) / out;
        padded_len = hi - lo;
        return;
    }
    i64 start = o * pool.stride[a];
    lo = start - pool.padding[a];
    if (lo < 0) lo = 0;
    if (lo > size) lo = size;
    hi = start + pool.kernel[a] - pool.padding[a];
    if (hi < 0) hi = 0;
    if (hi > size) hi = size;
    if (hi < lo) hi = lo;
    i64 end = start + pool.kernel[a];
    i64 padded = size + 2 * pool.padding[a];
    if (end > padded) end = padded;
    padded_len = end > start ? end - start : 0;
}

// What an average pool multiplies output (oh, ow)'s window sum by: the reciprocal, rounded to f32
// once, of how many positions of the padded input the window covers.
__device__ __forceinline__ float inverse_area(const Pool& pool, i64 oh, i64 ow) {
    i64 lo, hi, rows, cols;
    pool_window(pool, 0, oh, lo, hi, rows);
    pool_window(pool, 1, ow, lo, hi, cols);
    return 1.0f / (float)(rows * cols);
}

// Output point `i` of `tile` (its coordinates in `p`) and its input window clipped to the input:
// rows [h0, h1), columns [w0, w1).
__device__ void output_window(const Box4& tile, i64 i, const Pool& pool, i64 p[4], i64& h0,
                              i64& h1, i64& w0, i64& w1) {
    point_of(tile, i, p);
    i64 padded_len;
    pool_window(pool, 0, p[2], h0, h1, padded_len);
    pool_window(pool, 1, p[3], w0, w1, padded_len);
}

// Max: the largest value, first in row-major window order (`v > best`, as the CPU); avg: each
// window row summed left to right, the row sums added top to bottom, times inverse_area, as the
// CPU.
template <class T>
__device__ void pool2d_forward_t(const T* x, Box4 x_layout, T* y, Box4 tile, Pool pool, i64 n) {
    GRID_STRIDE(i, n) {
        i64 p[4], h0, h1, w0, w1;
        output_window(tile, i, pool, p, h0, h1, w0, w1);
        i64 q[4] = {p[0], p[1], 0, 0};
        if (pool.is_max) {
            float best = NEG_INF;
            for (i64 h = h0; h < h1; ++h) {
                q[2] = h;
                q[3] = w0;
                const T* row = x + offset_in(x_layout, q);
                for (i64 w = 0; w < w1 - w0; ++w) {
                    float v = to_f32(row[w]);
                    best = v > best ? v : best;
                }
            }
            y[i] = from_f32<T>(best);
        } else {
            float total = 0.0f;
            for (i64 h = h0; h < h1; ++h) {
                q[2] = h;
                q[3] = w0;
                const T* row = x + offset_in(x_layout, q);
                float row_sum = 0.0f;
                for (i64 w = 0; w < w1 - w0; ++w) row_sum = row_sum + to_f32(row[w]);
                total = total + row_sum;
            }
            y[i] = from_f32<T>(total * inverse_area(pool, p[2], p[3]));
        }
    }
}

// The (h, w) position of the first maximum of an output's window, in row-major window order.
template <class T>
__device__ void window_argmax(const T* x, const Box4& x_layout, i64 sample, i64 channel,
                              i64 h0, i64 h1, i64 w0, i64 w1, i64& best_h, i64& best_w) {
    float best = NEG_INF;
    best_h = h0;
    best_w = w0;
    i64 q[4] = {sample, channel, 0, w0};
    for (i64 h = h0; h < h1; ++h) {
        q[2] = h;
        const T* row = x + offset_in(x_layout, q);
        for (i64 w = w0; w < w1; ++w) {
            float v = to_f32(row[w - w0]);
            if (v > best) {
                best = v;
                best_h = h;
                best_w = w;
            }
        }
    }
}

// Max pooling's argmax, once per output of the tile: the input position (h · W + w, W the input
// width) of the window's first maximum, which the backward gather then reads instead of scanning
// every window again for every input element it covers.
template <class T>
__device__ void pool2d_argmax_t(const T* x, Box4 x_layout, Box4 tile, i64* argmax, Pool pool,
                                i64 n) {
    GRID_STRIDE(i, n) {
        i64 p[4], h0, h1, w0, w1;
        output_window(tile, i, pool, p, h0, h1, w0, w1);
        i64 best_h, best_w;
        window_argmax(x, x_layout, p[0], p[1], h0, h1, w0, w1, best_h, best_w);
        argmax[i] = best_h * pool.in_size[1] + best_w;
    }
}

// dx over the input view (dx laid out over x_layout): each element gathers, in the output order
// the CPU scatters in (rows, then columns, of the tile), the gradients of the tile's windows that
// route to it, so every sum is the CPU's, term by term. Max pooling reads each window's argmax
// (`pool2d_argmax`, laid out over the tile). Planes (n, c) outside the tile get zero.
template <class T>
__device__ void pool2d_backward_t(const i64* argmax, Box4 x_layout, const T* dy, Box4 tile, T* dx,
                                  Pool pool, i64 n) {
    GRID_STRIDE(i, n) {
        i64 p[4];
        point_of(x_layout, i, p);
        bool in_tile = p[0] >= tile.lo[0] && p[0] < tile.lo[0] + tile.ext[0] &&
                       p[1] >= tile.lo[1] && p[1] < tile.lo[1] + tile.ext[1];
        float grad = 0.0f;
        if (in_tile) {
            // Outputs o whose window holds position v, within the tile. Sliding, [o·s − pad,
            // o·s − pad + k): ceil((v + pad − k + 1) / s) <= o <= floor((v + pad) / s).
            // Adaptive: floor(v·out / in) <= o <= ceil((v + 1)·out / in) − 1, each checked.
            i64 first[2], last[2];
            for (int a = 0; a < 2; ++a) {
                i64 v = p[2 + a];
                if (pool.adaptive) {
                    i64 in = pool.in_size[a], out = pool.out_size[a];
                    first[a] = v * out / in;
                    last[a] = ((v + 1) * out + in - 1) / in - 1;
                } else {
                    i64 low = v + pool.padding[a] - pool.kernel[a] + 1;
                    first[a] = low <= 0 ? 0 : (low + pool.stride[a] - 1) / pool.stride[a];
                    last[a] = (v + pool.padding[a]) / pool.stride[a];
                }
                i64 tile_lo = tile.lo[2 + a], tile_hi = tile.lo[2 + a] + tile.ext[2 + a] - 1;
                if (first[a] < tile_lo) first[a] = tile_lo;
                if (last[a] > tile_hi) last[a] = tile_hi;
            }
            i64 here = p[2] * pool.in_size[1] + p[3];
            for (i64 oh = first[0]; oh <= last[0]; ++oh) {
                for (i64 ow = first[1]; ow <= last[1]; ++ow) {
                    if (pool.adaptive) {
                        i64 lo, hi, len;
                        pool_window(pool, 0, oh, lo, hi, len);
                        if (p[2] < lo || p[2] >= hi) continue;
                        pool_window(pool, 1, ow, lo, hi, len);
                        if (p[3] < lo || p[3] >= hi) continue;
                    }
                    i64 o[4] = {p[0], p[1], oh, ow};
                    i64 at = offset_in(tile, o);
                    float g = to_f32(dy[at]);
                    if (pool.is_max) {
                        if (argmax[at] == here) grad = grad + g;
                    } else {
                        grad = grad + g * inverse_area(pool, oh, ow);
                    }
                }
            }
        }
        dx[i] = from_f32<T>(grad);
    }
}

#define POOL_KERNELS(T, suffix)                                                                \
    extern "C" __global__ void pool2d_forward##suffix(const T* x, Box4 x_layout, T* y,        \
                                                      Box4 tile, Pool pool, i64 n) {           \
        pool2d_forward_t(x, x_layout, y, tile, pool, n);                                       \
    }                                                                                          \
    extern "C" __global__ void pool2d_argmax##suffix(const T* x, Box4 x_layout, Box4 tile,    \
                                                     i64* argmax, Pool pool, i64 n) {          \
        pool2d_argmax_t(x, x_layout, tile, argmax, pool, n);                                   \
    }                                                                                          \
    extern "C" __global__ void pool2d_backward##suffix(const i64* argmax, Box4 x_layout,      \
                                                       const T* dy, Box4 tile, T* dx,          \
                                                       Pool pool, i64 n) {                     \
        pool2d_backward_t(argmax, x_layout, dy, tile, dx, pool, n);                            \
    }
POOL_KERNELS(float, )
POOL_KERNELS(bf16, _bf16)

// ---------------------------------------------------------------------------------------------
// Softmax cross-entropy, one warp per sample row. Logits are laid out over rows
// [logits_row0, …) with all `classes` columns; the tile is rows [row0, row0 + rows).

#define WARP_ROWS_PER_BLOCK 8  // blocks of 8 warps (256 threads), one row each

// Row maximum and Σ exp(z − max) in f64 (at least 1). The sum is taken lane by lane and then in a
// tree, an order the CPU does not use: the last bits of the f64 sum may differ.
template <class T>
__device__ void row_max_sum(const T* z, i64 classes, float& max, double& sum) {
    int lane = threadIdx.x % WARP;
    float m = NEG_INF;
    for (i64 k = lane; k < classes; k += WARP) m = fmaxf(m, to_f32(z[k]));
    for (int offset = WARP / 2; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    double s = 0.0;
    for (i64 k = lane; k < classes; k += WARP) s += (double)expf(to_f32(z[k]) - m);
    for (int offset = WARP / 2; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
    max = m;
    sum = s;
}

// Per-sample loss log Σ exp(z) − z[label] (shifted by the row max), and whether the row's first
// largest logit is the label (`v > best` scanning in class order, as the CPU). The loss is fp32
// in every precision (bf16 logits are read to float).
template <class T>
__device__ void softmax_ce_rows_t(const T* logits, i64 logits_row0, i64 classes,
                                  const unsigned int* labels, i64 row0, i64 rows, float* loss,
                                  unsigned int* correct) {
    i64 r = (i64)blockIdx.x * WARP_ROWS_PER_BLOCK + threadIdx.x / WARP;
    if (r >= rows) return;  // a whole warp leaves together
    int lane = threadIdx.x % WARP;
    const T* z = logits + (row0 + r - logits_row0) * classes;
    float max;
    double sum;
    row_max_sum(z, classes, max, sum);
    // Each lane's first maximum over its classes, then the lowest class among equal maxima.
    float best = NEG_INF;
    i64 best_k = classes;
    for (i64 k = lane; k < classes; k += WARP) {
        float v = to_f32(z[k]);
        if (v > best) {
            best = v;
            best_k = k;
        }
    }
    for (int offset = WARP / 2; offset > 0; offset /= 2) {
        float other = __shfl_xor_sync(0xffffffffu, best, offset);
        i64 other_k = __shfl_xor_sync(0xffffffffu, best_k, offset);
        if (other > best || (other == best && other_k < best_k)) {
            best = other;
            best_k = other_k;
        }
    }
    if (best_k == classes) best_k = 0;  // no logit above -inf: the CPU keeps class 0
    if (lane == 0) {
        unsigned int label = labels[r];
        loss[r] = (float)(((double)max + log(sum)) - (double)to_f32(z[label]));
        correct[r] = best_k == (i64)label ? 1u : 0u;
    }
}

// The tile's loss sum (f64 of the f32 per-sample losses, as the CPU) and correct count, into
// out[0] and out[1]. One block of REDUCE_THREADS threads.
extern "C" __global__ void loss_totals(const float* loss, const unsigned int* correct, i64 rows,
                                       double* out) {
    double loss_sum = 0.0, correct_sum = 0.0;
    for (i64 r = threadIdx.x; r < rows; r += blockDim.x) {
        loss_sum += (double)loss[r];
        correct_sum += (double)correct[r];
    }
    block_sum2(loss_sum, correct_sum);
    if (threadIdx.x == 0) {
        out[0] = loss_sum;
        out[1] = correct_sum;
    }
}

// dlogits = (softmax(z) − onehot(label))·scale over the tile (laid out over it, all classes).
template <class T>
__device__ void softmax_ce_backward_t(const T* logits, i64 logits_row0, i64 classes,
                                      const unsigned int* labels, i64 row0, i64 rows, float scale,
                                      T* dlogits) {
    i64 r = (i64)blockIdx.x * WARP_ROWS_PER_BLOCK + threadIdx.x / WARP;
    if (r >= rows) return;
    int lane = threadIdx.x % WARP;
    const T* z = logits + (row0 + r - logits_row0) * classes;
    float max;
    double sum;
    row_max_sum(z, classes, max, sum);
    float norm = (float)((double)scale / sum);
    i64 label = labels[r];
    T* out = dlogits + r * classes;
    for (i64 k = lane; k < classes; k += WARP) {
        float o = expf(to_f32(z[k]) - max) * norm;
        out[k] = from_f32<T>(k == label ? o - scale : o);
    }
}

#define SOFTMAX_KERNELS(T, suffix)                                                             \
    extern "C" __global__ void softmax_ce_rows##suffix(                                        \
        const T* logits, i64 logits_row0, i64 classes, const unsigned int* labels, i64 row0,   \
        i64 rows, float* loss, unsigned int* correct) {                                        \
        softmax_ce_rows_t(logits, logits_row0, classes, labels, row0, rows, loss, correct);    \
    }                                                                                          \
    extern "C" __global__ void softmax_ce_backward##suffix(                                    \
        const T* logits, i64 logits_row0, i64 classes, const unsigned int* labels, i64 row0,   \
        i64 rows, float scale, T* dlogits) {                                                   \
        softmax_ce_backward_t(logits, logits_row0, classes, labels, row0, rows, scale,         \
                              dlogits);                                                        \
    }
SOFTMAX_KERNELS(float, )
SOFTMAX_KERNELS(bf16, _bf16)

// ---------------------------------------------------------------------------------------------
// Batch norm phases (kernels::batch_norm). Moments and gradient sums are [3, C] f64 laid out over
// [0..3, c0..c1): a row of element counts, then two rows of per-channel sums. Statistics are
// computed from them in f64 exactly as BatchStats::from_sums does, then rounded to f32 where the
// CPU rounds.

struct Stats {
    double count;
    double mean;
    double var;
    double inv_std;
};

// Statistics of global channel c from moments over channels [m_lo, m_lo + m_channels).
__device__ __forceinline__ Stats stats_of(const double* moments, i64 m_lo, i64 m_channels, i64 c,
                                          float eps) {
    Stats s;
    i64 j = c - m_lo;
    s.count = moments[0];
    s.mean = moments[m_channels + j] / s.count;
    // Rounding can push E[x²] − mean² slightly below zero for a constant channel.
    s.var = fmax(moments[2 * m_channels + j] / s.count - s.mean * s.mean, 0.0);
    s.inv_std = 1.0 / sqrt(s.var + (double)eps);
    return s;
}

// The per-channel sums are split over several blocks per channel, so that a layer with few
// channels and many elements a channel still fills the GPU: channel c's elements (n, then h, w:
// `per_channel` of them) are cut into `parts` contiguous ranges, block b sums range b % parts of
// channel b / parts into `partial` ([parts][2][C] f64), and a second kernel adds each channel's
// parts in order. The split and both trees are fixed, so the sums are the same every run.

// Σx and Σx² of one part of one channel of the tile, in f64.
template <class T>
__device__ void bn_moments_t(const T* x, Box4 x_layout, Box4 tile, i64 parts, double* partial) {
    i64 channels = tile.ext[1];
    ChannelPart part = channel_part(tile, parts);
    i64 n;
    Walk k = walk_from(tile, part.lo + threadIdx.x, n);
    Lane xs = lane_of(x_layout, tile, part.c, n, k);
    double sum = 0.0, sum_sq = 0.0;
    for (i64 j = part.lo + threadIdx.x; j < part.hi; j += blockDim.x) {
        double v = (double)to_f32(x[xs.at]);
        sum += v;
        sum_sq += v * v;
        walk_step(k);
        lane_step(xs, k);
    }
    block_sum2(sum, sum_sq);
    if (threadIdx.x == 0) {
        i64 p = blockIdx.x % parts;
        partial[2 * p * channels + part.local] = sum;
        partial[(2 * p + 1) * channels + part.local] = sum_sq;
    }
}

// out ([3, C]): the count, then each channel's two sums over its parts, added in order.
extern "C" __global__ void bn_sums_finish(const double* partial, i64 parts, i64 channels,
                                          i64 count, double* out) {
    GRID_STRIDE(c, channels) {
        double a = 0.0, b = 0.0;
        for (i64 p = 0; p < parts; ++p) {
            a += partial[2 * p * channels + c];
            b += partial[(2 * p + 1) * channels + c];
        }
        out[c] = (double)count;
        out[channels + c] = a;
        out[2 * channels + c] = b;
    }
}

// The element-wise batch-norm kernels read per-channel coefficients that a kernel of one thread
// per channel computes first (the f64 statistics, divisions and square roots once a channel,
// not once an element), rounded to f32 as the CPU's.

// coef ([3][channels] f32): mean, γ·invstd and β of channels [c_lo, c_lo + channels), as the
// CPU's Affine.
extern "C" __global__ void bn_affine(const double* moments, i64 m_lo, i64 m_channels,
                                     const float* gamma, i64 gamma_lo, const float* beta,
                                     i64 beta_lo, float eps, i64 c_lo, i64 channels,
                                     float* coef) {
    GRID_STRIDE(j, channels) {
        i64 c = c_lo + j;
        Stats s = stats_of(moments, m_lo, m_channels, c, eps);
        coef[j] = (float)s.mean;
        coef[channels + j] = (float)((double)gamma[c - gamma_lo] * s.inv_std);
        coef[2 * channels + j] = beta[c - beta_lo];
    }
}

// bn_affine's coefficients from the running statistics (inference): invstd = 1/√(var + eps) in
// f64, as the CPU's BatchStats::from_running.
extern "C" __global__ void bn_affine_running(const float* mean, i64 mean_lo, const float* var,
                                             i64 var_lo, const float* gamma, i64 gamma_lo,
                                             const float* beta, i64 beta_lo, float eps, i64 c_lo,
                                             i64 channels, float* coef) {
    GRID_STRIDE(j, channels) {
        i64 c = c_lo + j;
        double inv_std = 1.0 / sqrt((double)var[c - var_lo] + (double)eps);
        coef[j] = mean[c - mean_lo];
        coef[channels + j] = (float)((double)gamma[c - gamma_lo] * inv_std);
        coef[2 * channels + j] = beta[c - beta_lo];
    }
}

// One element of the normalisation: (x − mean)·(γ·invstd) + β, then max(·, 0) when `relu`.
__device__ __forceinline__ float bn_normalized(float x, float mean, float scale, float shift,
                                               int relu) {
    float z = (x - mean) * scale + shift;
    return (relu && z < 0.0f) ? 0.0f : z;
}

// An output gradient through batch norm's fused ReLU: g where y > 0 (or where no `y` is given,
// when the layer has no ReLU), else 0.
template <class T>
__device__ __forceinline__ float bn_relu_masked(float g, const T* y, i64 y_at) {
    return (y && !(to_f32(y[y_at]) > 0.0f)) ? 0.0f : g;
}

// One element of the input gradient: γ·invstd·(g − Σdy/M − x̂·Σ(dy·x̂)/M), x̂ = (x − mean)·invstd.
__device__ __forceinline__ float bn_input_gradient(float g, float x, float mean, float inv_std,
                                                   float scale, float mean_dy,
                                                   float mean_dy_xhat) {
    float xhat = (x - mean) * inv_std;
    return scale * (g - mean_dy - xhat * mean_dy_xhat);
}

// y = (x − mean)·(γ·invstd) + β, then max(·, 0) when `relu`, with bn_affine's coefficients of
// the tile's channels.
template <class T>
__device__ void bn_normalize_t(const T* x, Box4 x_layout, T* y, Box4 tile, const float* coef,
                               int relu, i64 parts) {
    i64 channels = tile.ext[1];
    ChannelPart part = channel_part(tile, parts);
    float mean = coef[part.local], scale = coef[channels + part.local],
          shift = coef[2 * channels + part.local];
    i64 n;
    Walk k = walk_from(tile, part.lo + threadIdx.x, n);
    Lane xs = lane_of(x_layout, tile, part.c, n, k);
    Lane ys = lane_of(tile, tile, part.c, n, k);
    for (i64 j = part.lo + threadIdx.x; j < part.hi; j += blockDim.x) {
        y[ys.at] = from_f32<T>(bn_normalized(to_f32(x[xs.at]), mean, scale, shift, relu));
        walk_step(k);
        lane_step(xs, k);
        lane_step(ys, k);
    }
}

// running = (1 − momentum)·running + momentum·batch in f64, the unbiased variance for running_var
// (the biased one with a single element per channel). One thread per channel of the moments.
extern "C" __global__ void bn_running(const double* moments, i64 m_lo, i64 m_channels,
                                      float* running_mean, i64 mean_lo, float* running_var,
                                      i64 var_lo, float momentum) {
    GRID_STRIDE(j, m_channels) {
        i64 c = m_lo + j;
        Stats s = stats_of(moments, m_lo, m_channels, c, 0.0f);
        double m = (double)momentum;
        double bessel = s.count > 1.0 ? s.count / (s.count - 1.0) : 1.0;
        float* rm = running_mean + (c - mean_lo);
        float* rv = running_var + (c - var_lo);
        *rm = (float)((1.0 - m) * (double)*rm + m * s.mean);
        *rv = (float)((1.0 - m) * (double)*rv + m * (s.var * bessel));
    }
}

// Σdy and Σdy·(x − mean) of one part of one channel of the tile (dy masked by y > 0 when `y`
// is given: the fused ReLU), into `partial` as bn_moments; bn_grad_sums_finish adds the parts.
template <class T>
__device__ void bn_grad_sums_t(const T* x, Box4 x_layout, const T* y, Box4 y_layout, const T* dy,
                               Box4 dy_layout, Box4 tile, const double* moments, i64 m_lo,
                               i64 m_channels, float eps, i64 parts, double* partial) {
    i64 channels = tile.ext[1];
    ChannelPart part = channel_part(tile, parts);
    Stats s = stats_of(moments, m_lo, m_channels, part.c, eps);
    i64 n;
    Walk k = walk_from(tile, part.lo + threadIdx.x, n);
    Lane xs = lane_of(x_layout, tile, part.c, n, k);
    Lane ys = lane_of(y_layout, tile, part.c, n, k);
    Lane dys = lane_of(dy_layout, tile, part.c, n, k);
    double sum_dy = 0.0, sum_dy_centered = 0.0;
    for (i64 j = part.lo + threadIdx.x; j < part.hi; j += blockDim.x) {
        double gd = (double)bn_relu_masked(to_f32(dy[dys.at]), y, ys.at);
        sum_dy += gd;
        sum_dy_centered += gd * ((double)to_f32(x[xs.at]) - s.mean);
        walk_step(k);
        lane_step(xs, k);
        lane_step(ys, k);
        lane_step(dys, k);
    }
    block_sum2(sum_dy, sum_dy_centered);
    if (threadIdx.x == 0) {
        i64 p = blockIdx.x % parts;
        partial[2 * p * channels + part.local] = sum_dy;
        partial[(2 * p + 1) * channels + part.local] = sum_dy_centered;
    }
}

// The tile's sums ([3, C] over its channels: count, Σdy, Σdy·x̂) from the parts, and its
// dγ = Σdy·x̂, dβ = Σdy.
extern "C" __global__ void bn_grad_sums_finish(const double* partial, i64 parts, i64 channels,
                                               i64 count, i64 c_lo, const double* moments,
                                               i64 m_lo, i64 m_channels, float eps,
                                               float* dgamma, i64 dgamma_lo, float* dbeta,
                                               i64 dbeta_lo, double* out) {
    GRID_STRIDE(c_local, channels) {
        i64 c = c_lo + c_local;
        Stats s = stats_of(moments, m_lo, m_channels, c, eps);
        double sum_dy = 0.0, sum_dy_centered = 0.0;
        for (i64 p = 0; p < parts; ++p) {
            sum_dy += partial[2 * p * channels + c_local];
            sum_dy_centered += partial[(2 * p + 1) * channels + c_local];
        }
        double sum_dy_xhat = sum_dy_centered * s.inv_std;
        out[c_local] = (double)count;
        out[channels + c_local] = sum_dy;
        out[2 * channels + c_local] = sum_dy_xhat;
        dgamma[c - dgamma_lo] = (float)sum_dy_xhat;
        dbeta[c - dbeta_lo] = (float)sum_dy;
    }
}

// coef ([5][channels] f32) of channels [c_lo, c_lo + channels) for bn_input_grad: mean, invstd,
// γ·invstd, Σdy/M and Σ(dy·x̂)/M, the CPU's f32 coefficients (InputGrad).
extern "C" __global__ void bn_input_coef(const double* moments, i64 m_lo, i64 m_channels,
                                         const float* gamma, i64 gamma_lo, const double* sums,
                                         i64 s_lo, i64 s_channels, float eps, i64 c_lo,
                                         i64 channels, float* coef) {
    GRID_STRIDE(j, channels) {
        i64 c = c_lo + j;
        Stats s = stats_of(moments, m_lo, m_channels, c, eps);
        i64 k = c - s_lo;
        double count = sums[0];
        coef[j] = (float)s.mean;
        coef[channels + j] = (float)s.inv_std;
        coef[2 * channels + j] = (float)((double)gamma[c - gamma_lo] * s.inv_std);
        coef[3 * channels + j] = (float)(sums[s_channels + k] / count);
        coef[4 * channels + j] = (float)(sums[2 * s_channels + k] / count);
    }
}

// dx = γ·invstd·(dy − Σdy/M − x̂·Σ(dy·x̂)/M) over the tile, with bn_input_coef's coefficients of
// the tile's channels; dy masked by y > 0 when `y` is given.
template <class T>
__device__ void bn_input_grad_t(const T* x, Box4 x_layout, const T* y, Box4 y_layout, const T* dy,
                                Box4 dy_layout, T* dx, Box4 tile, const float* coef, i64 parts) {
    i64 channels = tile.ext[1];
    ChannelPart part = channel_part(tile, parts);
    i64 c = part.local;
    float mean = coef[c], inv_std = coef[channels + c], scale = coef[2 * channels + c],
          mean_dy = coef[3 * channels + c], mean_dy_xhat = coef[4 * channels + c];
    i64 n;
    Walk k = walk_from(tile, part.lo + threadIdx.x, n);
    Lane xs = lane_of(x_layout, tile, part.c, n, k);
    Lane ys = lane_of(y_layout, tile, part.c, n, k);
    Lane dys = lane_of(dy_layout, tile, part.c, n, k);
    Lane dxs = lane_of(tile, tile, part.c, n, k);
    for (i64 j = part.lo + threadIdx.x; j < part.hi; j += blockDim.x) {
        float g = bn_relu_masked(to_f32(dy[dys.at]), y, ys.at);
        dx[dxs.at] = from_f32<T>(
            bn_input_gradient(g, to_f32(x[xs.at]), mean, inv_std, scale, mean_dy, mean_dy_xhat));
        walk_step(k);
        lane_step(xs, k);
        lane_step(ys, k);
        lane_step(dys, k);
        lane_step(dxs, k);
    }
}

// bn_normalize_t and bn_input_grad_t over a tile of one element per sample and channel (batch
// norm after a dense layer, [N, C]): consecutive threads on consecutive channels, so that their
// loads coalesce, where walking a channel would stride a whole row per element. `packed` says
// every operand is laid out over exactly the tile.
template <class T>
__device__ void bn_normalize_rows_t(const T* x, Box4 x_layout, T* y, Box4 tile, const float* coef,
                                    int relu, i64 n, int packed) {
    i64 channels = tile.ext[1];
    GRID_STRIDE(i, n) {
        i64 j = row_channel(i, channels);
        y[i] = from_f32<T>(bn_normalized(to_f32(x[at(x_layout, tile, i, packed)]), coef[j],
                                         coef[channels + j], coef[2 * channels + j], relu));
    }
}

template <class T>
__device__ void bn_input_grad_rows_t(const T* x, Box4 x_layout, const T* y, Box4 y_layout,
                                     const T* dy, Box4 dy_layout, T* dx, Box4 tile,
                                     const float* coef, i64 n, int packed) {
    i64 channels = tile.ext[1];
    GRID_STRIDE(i, n) {
        i64 j = row_channel(i, channels);
        i64 y_at = y ? at(y_layout, tile, i, packed) : 0;
        float g = bn_relu_masked(to_f32(dy[at(dy_layout, tile, i, packed)]), y, y_at);
        dx[i] = from_f32<T>(bn_input_gradient(g, to_f32(x[at(x_layout, tile, i, packed)]),
                                              coef[j], coef[channels + j], coef[2 * channels + j],
                                              coef[3 * channels + j], coef[4 * channels + j]));
    }
}

// The batch-norm kernels that read or write activations, once per activation type; the
// statistics, coefficients, γ, β and their gradients are f32 and f64 in every precision.
#define BN_KERNELS(T, suffix)                                                                  \
    extern "C" __global__ void bn_moments##suffix(const T* x, Box4 x_layout, Box4 tile,       \
                                                  i64 parts, double* partial) {                \
        bn_moments_t(x, x_layout, tile, parts, partial);                                       \
    }                                                                                          \
    extern "C" __global__ void bn_normalize##suffix(const T* x, Box4 x_layout, T* y,          \
                                                    Box4 tile, const float* coef, int relu,    \
                                                    i64 parts) {                               \
        bn_normalize_t(x, x_layout, y, tile, coef, relu, parts);                               \
    }                                                                                          \
    extern "C" __global__ void bn_grad_sums##suffix(                                           \
        const T* x, Box4 x_layout, const T* y, Box4 y_layout, const T* dy, Box4 dy_layout,     \
        Box4 tile, const double* moments, i64 m_lo, i64 m_channels, float eps, i64 parts,      \
        double* partial) {                                                                     \
        bn_grad_sums_t(x, x_layout, y, y_layout, dy, dy_layout, tile, moments, m_lo,           \
                       m_channels, eps, parts, partial);                                       \
    }                                                                                          \
    extern "C" __global__ void bn_input_grad##suffix(                                          \
        const T* x, Box4 x_layout, const T* y, Box4 y_layout, const T* dy, Box4 dy_layout,     \
        T* dx, Box4 tile, const float* coef, i64 parts) {                                      \
        bn_input_grad_t(x, x_layout, y, y_layout, dy, dy_layout, dx, tile, coef, parts);       \
    }                                                                                          \
    extern "C" __global__ void bn_normalize_rows##suffix(const T* x, Box4 x_layout, T* y,     \
                                                         Box4 tile, const float* coef,         \
                                                         int relu, i64 n, int packed) {        \
        bn_normalize_rows_t(x, x_layout, y, tile, coef, relu, n, packed);                      \
    }                                                                                          \
    extern "C" __global__ void bn_input_grad_rows##suffix(                                     \
        const T* x, Box4 x_layout, const T* y, Box4 y_layout, const T* dy, Box4 dy_layout,     \
        T* dx, Box4 tile, const float* coef, i64 n, int packed) {                              \
        bn_input_grad_rows_t(x, x_layout, y, y_layout, dy, dy_layout, dx, tile, coef, n,       \
                             packed);                                                          \
    }
BN_KERNELS(float, )
BN_KERNELS(bf16, _bf16)

// ---------------------------------------------------------------------------------------------
// SGD with momentum, element-wise: d = g + wd·w; v = μ·v + d; w −= lr·v (train::Sgd::update).

extern "C" __global__ void sgd_update(const float* grad, float* w, float* velocity, i64 n,
                                      float lr, float momentum, float weight_decay) {
    GRID_STRIDE(i, n) {
        float d = grad[i] + weight_decay * w[i];
        float v = momentum * velocity[i] + d;
        velocity[i] = v;
        w[i] = w[i] - lr * v;
    }
}
