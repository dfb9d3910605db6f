// The C ABI of kvd's native CPU kernels, declared once: every kernel file includes this header (through
// cpu_internal.h), and kvd/kernels/native_build.py hands the declarations between the markers below to cffi, which
// calls them (and reads the constants: kvd.kernels.cpu_native lays out weights by them).
// Keep the part between the markers plain declarations: no preprocessor lines, no inline code.
#ifndef KVD_CPU_KERNELS_H
#define KVD_CPU_KERNELS_H

#include <stdint.h>

// cffi: begin

// What every kernel that can fail returns. KVD_BAD_INDEX: a slot, block table entry, context length, position
// or row range lies outside the buffer it indexes; the kernel refused it before writing anything.
// KVD_UNSUPPORTED: this build or CPU lacks what the call needs (AMX tiles or AVX-512 BF16 for a bf16 weight in kernel order).
enum kvd_status { KVD_OK = 0, KVD_OUT_OF_MEMORY = -1, KVD_BAD_INDEX = -2, KVD_UNSUPPORTED = -3 };

// An 8-bit KV pool row (kvd_paged_attention's kv8): a head's D codes, then this many bytes of its float32 scale.
enum kvd_kv8 { KVD_KV8_SCALE_BYTES = 4 };

// A quantized weight's blocks (kvd_weight): KVD_QBLOCK codes along k a block, in groups of KVD_GROUP_ROWS rows.
enum kvd_block { KVD_QBLOCK = 32, KVD_GROUP_ROWS = 8 };

// GGUF's super-block types that a linear runs from in the file's own bytes (kvd_weight.ggml, the type ids as
// GGUF numbers them): KVD_SUPER_BLOCK values along k a block, each row n / KVD_SUPER_BLOCK blocks one after
// another, as the file stores them (block_q4_K: fp16 d, dmin, 12 bytes of 6-bit sub-block scales and minimums,
// 128 bytes of 4-bit codes; block_q5_K: the same with 32 bytes of fifth bits before the codes; block_q6_K: 128
// bytes of low 4 bits, 64 of high 2 bits, 16 int8 sub-block scales, fp16 d; block_iq4_xs: fp16 d, 16 bits of
// high 2 scale bits, 4 bytes of low 4 scale bits, 128 bytes of 4-bit indices into IQ4's table of 16 int8 values).
enum kvd_ggml { KVD_GGML_Q4_K = 12, KVD_GGML_Q5_K = 13, KVD_GGML_Q6_K = 14, KVD_GGML_IQ4_XS = 23 };
enum kvd_super { KVD_SUPER_BLOCK = 256, KVD_SUPER_PACK_ROWS = 16 };  // rows a group of kvd_super_pack's layout

// GGUF's F16 type number, for kvd_weight.ggml of a float weight of fp16 values (bits 16 alone: bf16 values).
enum kvd_half { KVD_GGML_F16 = 1 };

// A linear's weight [n, k]: 4-bit (bits 4: 16 bytes a block, byte i holding code i in its low nibble and code
// i + 16 in its high one, codes 0..15, an fp16 scale d and minimum mn), 5-bit (bits 5: GGUF's Q5_0 and Q5_1; the
// 4-bit layout holds each code's low four bits and qh its fifth: bit i of a block's word is code i's, codes 0..31)
// or 8-bit (bits 8: 32 int8 codes a block, an fp16 scale d, mn NULL) blocks of 32 along k, or float (bits 32: qs
// float32 [n, k]; bits 16: qs bf16 [n, k]; d and mn NULL); qh NULL but for bits 5; bias float32 [n] or NULL. The blocks lie in groups of 8 rows, each read as one stream: group g
// holds blocks 2p and 2p + 1 of its 8 rows (row after row, the two blocks of a row side by side) for p = 0, 1, ...,
// then an odd last block of its 8 rows; d, mn and qh are [groups][k / 32][8]; rows past n up to a whole group are
// padding (kvd.kernels.cpu_native.group_blocks lays this out). tiles: 1 for a float weight in its kernel's packed
// order, multiplied in one order for every row count: a bf16 weight in AMX tile order, a float32 one in panel
// order (kvd.kernels.cpu_native.pack says both); 0 for a float weight in rows, and for every quantized one.
// ggml: 0 for the layouts above; a kvd_ggml type for a weight in that type's super-blocks at qs (rows of
// k / KVD_SUPER_BLOCK blocks; d, mn NULL, bits 0; tiles 0, or 1 once kvd_super_pack rewrote them); KVD_GGML_F16 for a float weight of fp16 values in
// rows (bits 16, tiles 0: a GGUF F16 matrix, widened exactly as it is read).
typedef struct {
    const void* qs;
    const uint16_t* d;
    const uint16_t* mn;
    const uint32_t* qh;  // bits 5 alone
    const float* bias;
    int64_t n, k;
    int32_t bits, tiles, ggml;
} kvd_weight;

// A fused projection (q, k, v or gate, up) holds up to KVD_MAX_PARTS weights stacked by rows, each in its own
// layout (a GGUF file's attn_v in Q6_K beside Q4_K q and k): its output's columns are part 0's, then part 1's...;
// the parts after the last have n = 0.
enum kvd_parts { KVD_MAX_PARTS = 3 };

// A mixture of experts (kvd_moe_forward, kvd_layer.moe) over hidden-wide activations: router, a float weight
// [num_experts, hidden], scores each token's experts; scoring KVD_SOFTMAX_TOPK: a softmax over every expert, the top_k
// kept (with normalize, rescaled to sum to 1), KVD_TOPK_SOFTMAX: a softmax over the top_k logits alone. Expert e's
// weights are experts[e * KVD_EXPERT_WEIGHTS ...]: its gate/up projection's parts (KVD_MAX_PARTS, stacked as a fused
// projection's, n = 0 after the last; gate's intermediate columns, then up's), then down [hidden, intermediate].
// Its activation (act): KVD_ACT_SILU and KVD_ACT_GELU_TANH as kvd_silu_mul and kvd_gelu_tanh_mul,
// KVD_ACT_CLAMPED_SWIGLU g sigmoid(alpha g) (u + 1) with g = min(gate, limit) and u = up clipped to +-limit.
// A token's output: its experts' outputs (in the dtype) times their weights, summed in float32 in ascending expert
// order, then rounded to the dtype; the tokens of each expert run together, every row as kvd_linear computes it
// alone, so a token's output never depends on the others. With shared_size > 0, a shared expert (weights shared[],
// laid out as one expert's, of width shared_size) runs on every token and is added scaled by sigmoid(shared_gate . x),
// shared_gate a float weight [1, hidden]: out = routed + sigmoid(g) x shared, each step rounded in the dtype.
enum kvd_moe_scoring { KVD_SOFTMAX_TOPK = 0, KVD_TOPK_SOFTMAX = 1 };
enum kvd_moe_act { KVD_ACT_SILU = 0, KVD_ACT_GELU_TANH = 1, KVD_ACT_CLAMPED_SWIGLU = 2 };
enum kvd_moe_weights { KVD_EXPERT_WEIGHTS = 4 };  // KVD_MAX_PARTS gate/up parts, then down
typedef struct {
    kvd_weight router;
    const kvd_weight* experts;
    int64_t num_experts, top_k, hidden, intermediate;
    int32_t scoring, normalize, act;
    float alpha, limit;
    kvd_weight shared[KVD_EXPERT_WEIGHTS];
    kvd_weight shared_gate;
    int64_t shared_size;
} kvd_moe;

// out [M, hidden] = the mixture of experts of x [M, hidden] (bf16: both bfloat16, else float32); KVD_BAD_INDEX for
// top_k outside 1..num_experts, else the first failing kernel's status.
int kvd_moe_forward(const kvd_moe* moe, const void* x, int bf16, int64_t M, void* out, int nthreads);

// A Gated DeltaNet layer (kvd_layer.recurrent) as kvd_gated_delta runs it: its input projections' parts (qkv
// [C, hidden], z [Hv dv, hidden], b and a [Hv, hidden]; stacked parts as a fused projection's), the convolution's
// filters [C, K] and the decay's A_log and dt_bias [Hv] in float32, its slots' windows and states (conv_state,
// state, num_slots of each), the output norm's scale [dv] (model dtype; kvd_gated_rms_norm with z) and out
// [hidden, Hv dv].
typedef struct {
    kvd_weight qkv[KVD_MAX_PARTS];
    kvd_weight z[KVD_MAX_PARTS];
    kvd_weight b[KVD_MAX_PARTS];
    kvd_weight a[KVD_MAX_PARTS];
    kvd_weight out;
    const float* conv_weight;
    const float* A_log;
    const float* dt_bias;
    const void* norm;
    void* conv_state;
    float* state;
    int64_t num_slots, key_heads, value_heads, key_dim, value_dim, conv_kernel;
    int32_t tiled;
} kvd_recurrent;

// A step's rows as the Gated DeltaNet layers read them (kvd_gated_delta's starts .. snap_slots and its S, here
// `sequences`; starts[sequences] is the step's row count): in a decode step sequence s owns row s.
typedef struct {
    int64_t sequences;
    const int64_t* starts;
    const int64_t* slots;
    const int64_t* sources;
    const int64_t* snap_starts;
    const int64_t* snap_rows;
    const int64_t* snap_slots;
} kvd_recurrent_step;

// One decoder layer's weights and its KV pool [2, num_blocks, block_size, kv_heads, head_dim]; the norm weights,
// rotary table and pool in the model's dtype (kvd_shape.bf16).
typedef struct {
    const void* input_norm;
    const void* post_attention_norm;
    const void* q_norm;  // NULL without per-head q/k norms
    const void* k_norm;
    const void* attn_output_norm;  // NULL, or the norm of the attention's output before its residual add
    const void* mlp_output_norm;   // likewise of the MLP's
    const void* cos_sin;           // the rotary table [kvd_shape.num_positions, 2 rotary_dim] (kvd_rotary)
    kvd_weight qkv[KVD_MAX_PARTS];
    kvd_weight o;
    kvd_weight gate_up[KVD_MAX_PARTS];
    kvd_weight down;
    void* kv_cache;
    int64_t window;      // 0, or the sliding window of this layer's attention (kvd_paged_attention)
    const float* sinks;  // NULL, or this layer's attention sinks (kvd_paged_attention)
    int32_t gelu;        // the MLP's gate: 0 SiLU (kvd_silu_mul), 1 tanh-approximated GELU (kvd_gelu_tanh_mul)
    int32_t kv_group;    // the KV group whose block tables this layer's pool is read through (kvd_kv_group)
    const kvd_moe* moe;  // NULL, or the mixture of experts that replaces gate_up and down
    const kvd_recurrent* recurrent;  // NULL, or the Gated DeltaNet that replaces the attention (no KV pool)
} kvd_layer;

// A KV group's step tables (kvd_decode_layers): the slot of each new token's K/V [S] and the block tables
// [S, table_width] of the group's layers (a sliding-window group has its own, from kvd.model.layers.kv_cache).
typedef struct {
    const int64_t* slots;
    const int32_t* tables;
    int64_t table_width;
} kvd_kv_group;

// bf16: 1 when the activations, norm weights, rotary table and KV pool are bfloat16, 0 for float32; kv8: 1 when
// the pool holds 8-bit rows instead (kvd_paged_attention); output_gate: 1 when each query head's projection is
// followed by as many gate values, whose sigmoid scales that head's attention output (kvd_sigmoid_mul).
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, rotary_dim, intermediate, num_blocks, block_size, num_positions;
    float eps, scale;
    int32_t bf16, kv8, output_gate;
} kvd_shape;

// The instruction sets this build's SIMD paths use: "avx2+fma", with "+avx512" or "+avx512-bf16" (bf16 linears by
// pair products where there is no AMX), "+vnni" (with AVX-512: quantized linears by VNNI outer products where there
// is no AMX), "+amx-int8" and "+amx-bf16" where the CPU has them (and Linux grants the tiles), or "portable" (plain
// C): the paths the kernels take in this process. Every build computes the same quantized and float32 panel
// results bit for bit (float weights in rows sum in SIMD lanes or in order: each build's own bits).
const char* kvd_isa(void);

// Whether bf16 weights in tile order can be multiplied here: in AMX tiles (built with AMX-BF16, and Linux grants
// the tiles), else by AVX-512 BF16 pair products.
int kvd_bf16_kernel_order(void);

// y [M, n] = x [M, k] @ W^T (+ bias); float32 or bf16 activations (x_bf16, y_bf16). Each output row is
// computed in one order whatever M is (batch invariance): integer block dots for 4- and 8-bit weights, float32
// products and sums for float weights.
int kvd_linear(const kvd_weight* w, const void* x, int x_bf16, int64_t M, void* y, int y_bf16, int nthreads);

// dst [n, row_bytes] = a super-block weight's rows src as the file stores them (src == dst: in place), rewritten
// into the layout this build's kernels read fastest where it has one for the type (each whole group of 16 rows
// interleaved, the rows after the last group as they were; kvd_weight.tiles 1 then): 1 when packed, 0 when copied
// as they are, KVD_BAD_INDEX for a type that is not a super-block type or row_bytes that is not k /
// KVD_SUPER_BLOCK of its blocks, KVD_OUT_OF_MEMORY (in place) without a group's scratch.
int kvd_super_pack(int32_t ggml, const void* src, void* dst, int64_t n, int64_t k, int64_t row_bytes, int nthreads);

// out [count, k] (float32, or bf16 when out_bf16) = rows first .. first + count of a 4- or 8-bit weight, or of a
// super-block one.
int kvd_dequantize(const kvd_weight* w, int64_t first, int64_t count, void* out, int out_bf16, int nthreads);

// out [S, H, D] = softmax(q K^T * scale) V for each query row s (q: row s at s x q_stride) over the first
// context_lens[s] tokens of its own block table row, read in place from the pool [2, num_blocks, block_size,
// kv_heads, D] through block_tables [S, table_width]: a decode token per sequence, or any token of a prompt
// (its causal context), each reduced in the same order. Query heads h share kv head h / (H / kv_heads). q and
// out are bf16 or float32 (bf16); the pool holds that dtype too, or with kv8 8-bit rows [2, num_blocks,
// block_size, kv_heads, D + 4]: D codes and a float32 scale each (keys' codes + 128, values' signed), which the
// query heads meet quantized the same way (integer dot products). window > 0: each row sees only the last
// `window` tokens of its context (a sliding-window layer), and no block before the one holding the first of them
// is read, so a table's earlier entries may be any block in range. sinks: NULL, or a float32 logit per query head
// that joins each softmax's denominator (attention sinks: weight that attends to nothing).
int kvd_paged_attention(const void* q, int64_t q_stride, void* out, const void* pool, int bf16, int kv8,
                               int64_t num_blocks, int64_t block_size, int64_t kv_heads, int64_t D, int64_t S,
                               int64_t H, const int32_t* block_tables, int64_t table_width,
                               const int32_t* context_lens, int64_t window, const float* sinks, float scale,
                               int nthreads);

// The pool's K and V rows at slots[t] = k[t], v[t] (kv_heads x D values; token t at t x k_stride in k, t x
// v_stride in v), quantized per head into an 8-bit pool (kv8, as kvd_paged_attention reads it); slot -1 is
// skipped.
int kvd_store_kv(const void* k, int64_t k_stride, const void* v, int64_t v_stride, void* pool, int bf16, int kv8,
                 int64_t num_slots, int64_t kv_heads, int64_t D, const int64_t* slots, int64_t T);

// Rotate the first R values of each head of x [T, heads, D] (token t at t x stride; R even, R = D unless the model
// rotates part of a head) in place by the rows of cos_sin [num_positions, 2 * R] (cos | signed sin) at positions[t].
int kvd_rotary(void* x, int64_t stride, int bf16, int64_t T, int64_t heads, int64_t D, int64_t R,
               const void* cos_sin, int64_t num_positions, const int64_t* positions, int nthreads);

// RMSNorm over each head's D values of x [tokens, heads, D] (token t at t x stride, out at t x out_stride; out
// may be x). x, out and weight share one dtype: float32, or bf16 (normalized in float32 and rounded, then
// scaled by the weight and rounded again, as transformers computes it).
void kvd_rms_norm(const void* x, int64_t stride, void* out, int64_t out_stride, int64_t tokens, int64_t heads,
                  int64_t D, const void* weight, float eps, int bf16);

// residual [M, H] += x (rounded to the dtype); out = RMSNorm(residual) * weight, as kvd_rms_norm.
void kvd_add_rms_norm(const void* x, void* residual, const void* weight, void* out, int64_t M, int64_t H,
                      float eps, int bf16, int nthreads);

// out [T, I] = silu(gate) x up, gate and up [T, I] with rows `stride` apart (float32, or bf16: silu rounded,
// then the product rounded, as torch computes it).
void kvd_silu_mul(const void* gate, const void* up, int64_t stride, void* out, int64_t T, int64_t I, int bf16,
                  int nthreads);

// As kvd_silu_mul with gelu(gate) (tanh approximation: gate x sigmoid(2 sqrt(2 / pi) (gate + 0.044715 gate^3))).
void kvd_gelu_tanh_mul(const void* gate, const void* up, int64_t stride, void* out, int64_t T, int64_t I,
                       int bf16, int nthreads);

// out [T, n] = x x sigmoid(gate), x and gate [T, n] contiguous (float32, or bf16: the sigmoid rounded, then the
// product rounded, as torch computes x * sigmoid(gate)).
void kvd_sigmoid_mul(const void* x, const void* gate, void* out, int64_t T, int64_t n, int bf16, int nthreads);

// out [T, H, D] = RMSNorm(x) x weight (as kvd_rms_norm, each head alone) times silu(gate) in float32, rounded once
// to the dtype (the Gated DeltaNet's output norm); x, gate, out [T, H, D] contiguous, out may be x.
void kvd_gated_rms_norm(const void* x, const void* gate, void* out, int64_t T, int64_t H, int64_t D,
                        const void* weight, float eps, int bf16, int nthreads);

// out[r] = the index of the largest value of row r of x [rows, n] (float32, n >= 1): the first of equal ones, and
// the first NaN where the row holds one, as torch.argmax answers (greedy sampling over the logits).
void kvd_argmax(const float* x, int64_t rows, int64_t n, int64_t* out, int nthreads);

// Every decoder layer for S sequences of one new token each, in the model's dtype: hidden [S, hidden] (the
// embeddings in, the last layer's MLP output out) and residual [S, hidden] (zeros in, the stream before that
// output out). positions [S]; each KV group's slots and block tables (kvd_kv_group, num_groups of them, layer l
// reading groups[layers[l].kv_group]) and the context lengths [S] as for the attention above; recurrent: the
// step's rows for the Gated DeltaNet layers (NULL when there are none).
int kvd_decode_layers(const kvd_shape* m, const kvd_layer* layers, int64_t num_layers, void* hidden,
                      void* residual, int64_t S, const int64_t* positions, const kvd_kv_group* groups,
                      int64_t num_groups, const int32_t* lens, const kvd_recurrent_step* recurrent, int nthreads);

// A Gated DeltaNet layer (linear attention; Qwen3.5) over S sequences' rows of one step: sequence s owns rows
// starts[s] .. starts[s + 1] (starts[0] = 0) and state slot slots[s]; its state starts from slot sources[s] (-1:
// zeros; slots[s]: as the last step left it; another slot: a checkpoint, copied). qkv [T, C] (C = 2 Hk dk + Hv dv:
// q's Hk heads, k's, then v's Hv heads) is the input projection, a and b [T, Hv] the decay's and the update's
// projections, all in the dtype (bf16 or float32). The causal convolution (conv_weight [C, K], K <= 17) reads
// each channel's last K - 1 inputs from conv_state [num_slots, K - 1, C] (dtype) and leaves the sequence's last
// ones there; its SiLU output is rounded to the dtype. Then per value head h (sharing key head h / (Hv / Hk), or
// with tiled h % Hk),
// token after token: q and k L2-normalized (q also by 1 / sqrt(dk)), the state [dk, dv] of
// state [num_slots, Hv, dk, dv] (float32) decayed by exp(-exp(A_log[h]) softplus(a + dt_bias[h])), updated by
// k (sigmoid(b) (v - S^T k))^T, and out [T, Hv dv] (dtype) = S^T q. Snapshots: sequence s's are
// snap_starts[s] .. snap_starts[s + 1] (snap_starts[0] = 0): after row snap_rows[i] of the sequence's (ascending),
// its window and state are copied into slot snap_slots[i] too (a checkpoint at a block boundary, or the state after
// each row of a speculative draft). KVD_BAD_INDEX, before any write, for a slot out of range, a slot written twice
// (live or snapshot), a source another sequence writes, snapshot rows outside their rows or out of order, starts
// that go back, or K out of range.
int kvd_gated_delta(const void* qkv, const void* a, const void* b, const float* conv_weight, const float* A_log,
                    const float* dt_bias, void* conv_state, float* state, int64_t num_slots, const int64_t* starts,
                    const int64_t* slots, const int64_t* sources, const int64_t* snap_starts,
                    const int64_t* snap_rows, const int64_t* snap_slots, int64_t S, int64_t Hk, int64_t Hv, int64_t dk,
                    int64_t dv, int64_t K, int tiled, int bf16, void* out, int nthreads);
// cffi: end

#endif
