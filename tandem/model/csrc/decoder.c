/* A Llama-family decoder forward pass for x86 CPUs: every layer of a batch of prefill, decode
   and verify chunks in one call, on a persistent thread pool, over a paged KV cache: each
   sequence slot reads and writes its K/V through its block table (tandem/model/kv_cache.py).

   Why not PyTorch ops: on this kind of CPU a decode step of a small model spends as long in the
   ~20 small ATen calls per layer (norms, RoPE, SDPA, SiLU, residuals) as in streaming weights.
   Here each layer is eight phases separated by barriers, and nothing leaves C until the logits.
   PyTorch alternatives measured on SmolLM2-135M, one thread, decode: Inductor (cpp wrapper) 67 ms
   bf16 / 64 ms fp32 and oneDNN's prepacked bf16 linears 37 ms for the matrices alone, against
   20 / 38 ms here for the whole step.

   Semantics (tandem/model/torch_decoder.py is the PyTorch reference the tests compare with):
   the residual stream, norms, RoPE, softmax and accumulation are fp32; with bf16 weights the
   inputs of each matrix multiply are rounded to bf16 (as torch's bf16 path does), and the KV
   cache may be bf16 or fp16. Each row's result depends only on its own tokens and cache, never on the
   batch, the row tiling or the number of threads: greedy output with speculation stays
   token-identical to the target alone. */
#include <math.h>
#include <stdlib.h>

#include "gemm.h"
#include "pool.h"
#include "vec.h"

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };  /* the KV cache's element type */

#define KEY_BLOCK 16     /* positions per KV page (kv_cache.PAGE_SIZE); K pages are [head_dim, 16],
                            so a page's scores are vector FMAs */

typedef struct {
    const float* attn_norm;
    PackedMatrix qkv;
    const float* qkv_bias;  /* [qkv.rows] or NULL */
    PackedMatrix o;
    const float* mlp_norm;
    PackedMatrix gate_up;   /* gate rows, then up rows */
    PackedMatrix down;
    void* k_cache;          /* [kv_heads, pool blocks, head_dim, 16] */
    void* v_cache;          /* [kv_heads, pool blocks * 16, head_dim] */
} Layer;

typedef struct {
    int hidden, intermediate, num_layers, num_heads, num_kv_heads, head_dim;
    int max_len;            /* positions per KV slot, a multiple of KEY_BLOCK */
    int64_t pool_positions; /* pool blocks * KEY_BLOCK: one KV head's share of a layer's cache */
    const int32_t* block_tables;  /* [slots, max_len / KEY_BLOCK]: a slot's position p is in block
                                     block_tables[slot][p / KEY_BLOCK] */
    int weights_kind, kv_type;  /* WEIGHTS_F32, WEIGHTS_BF16, WEIGHTS_BLOCKS or WEIGHTS_BLOCKS_X8 (gemm.h); KV_F32, KV_BF16 or KV_F16 */
    float eps;
    const float* rope_cos;  /* [max_len, head_dim / 2] */
    const float* rope_sin;
    const void* embed;      /* [vocab, hidden] rows in the weight dtype, or a PackedMatrix of block
                               groups; NULL: the lm_head's rows */
    const float* final_norm;
    PackedMatrix lm_head;
    const Layer* layers;
} Model;

typedef struct {
    int num_tokens;
    const int64_t* token_ids;    /* [T] */
    const int64_t* positions;    /* [T] */
    int num_chunks;
    const int32_t* chunk_slots;  /* [C] */
    const int32_t* chunk_starts; /* [C + 1]: chunk c is tokens [starts[c], starts[c + 1]) */
    int num_out;
    const int32_t* out_tokens;   /* [num_out]: the tokens whose logits (or hidden state) come out */
    int want_hidden;             /* out gets the final normed hidden state instead of logits */
    float* out;                  /* [num_out, lm_head.panels * 16] or [num_out, hidden] */
    int num_capture;             /* layers whose input residual stream comes out in captured; 0: none */
    const int32_t* capture_layers;  /* [num_capture], ascending */
    float* captured;             /* [T, num_capture, hidden]: the residual stream entering each listed layer */
} Batch;

typedef struct {
    const Model* m;
    const Batch* b;
    Barrier barrier;
    float* hidden;   /* [T, hidden], the residual stream */
    void* gin;       /* [T, widest K]: the next matrix multiply's input, fp32, bf16, XBlocks or XBlock8s */
    float* qkv;      /* [T, qkv ldy] */
    float* attn;     /* [T, heads * head_dim], fp32 weights only: the o projection's input */
    float* y;        /* [T, hidden ldy]: o and down projections */
    float* gate_up;  /* [T, gate_up ldy] */
    float* scratch;  /* per thread: attention scores and outputs */
    int64_t scratch_floats;
} Forward;

static inline int ldy_of(const PackedMatrix* w) { return w->panels * PANEL; }

/* Columns [col, col + n) of row `row` of a matrix multiply's input with `cols` columns, in the
   form the weights take: fp32, bf16, or blocks of 32 (col and n multiples of 32). */
static inline void put_input_at(const Model* m, void* gin, int row, int cols, int col, const float* src, int n) {
    int64_t at = (int64_t)row * cols + col;
    if (m->weights_kind == WEIGHTS_BLOCKS) {
        quantize_row(src, n, (XBlock*)gin + at / QBLOCK);
    } else if (m->weights_kind == WEIGHTS_BLOCKS_X8) {
        quantize_row8(src, n, (XBlock8*)gin + at / QBLOCK);
    } else if (m->weights_kind == WEIGHTS_BF16) {
        uint16_t* dst = (uint16_t*)gin + at;
        for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float*)gin + at, src, sizeof(float) * n);
    }
}

static inline void put_input(const Model* m, void* gin, int row, int cols, const float* src) {
    put_input_at(m, gin, row, cols, 0, src, cols);
}

static void rms_norm(const float* x, const float* weight, int n, float eps, float* out) {
    vf acc = v_splat(0.0f);
    int i = 0;
    for (; i + LANES <= n; i += LANES) {
        vf v = v_load(x + i);
        acc += v * v;
    }
    float sum = v_sum(acc);
    for (; i < n; i++) sum += x[i] * x[i];
    float scale = 1.0f / sqrtf(sum / n + eps);
    for (i = 0; i < n; i++) out[i] = x[i] * scale * weight[i];
}

static void embed_row(const Model* m, int64_t id, float* out) {
    int h = m->hidden;
    if (is_blocks(m->weights_kind)) {
        const PackedMatrix* rows = m->embed != NULL ? m->embed : &m->lm_head;
        dequantize_row(rows->data, rows->groups, id, h, out);
        return;
    }
    if (m->embed != NULL) {
        if (m->weights_kind == WEIGHTS_BF16) {
            const uint16_t* row = (const uint16_t*)m->embed + id * h;
            for (int k = 0; k < h; k++) out[k] = bf16_to_f32(row[k]);
        } else {
            memcpy(out, (const float*)m->embed + id * h, sizeof(float) * h);
        }
        return;
    }
    int64_t panel = id / PANEL, lane = id % PANEL;
    if (m->weights_kind == WEIGHTS_BF16) {  /* [panels, K/2, 16, 2] */
        const uint16_t* p = (const uint16_t*)m->lm_head.data + panel * h * PANEL;
        for (int k = 0; k < h; k++) out[k] = bf16_to_f32(p[(k / 2) * 2 * PANEL + lane * 2 + k % 2]);
    } else {                /* [panels, K, 16] */
        const float* p = (const float*)m->lm_head.data + panel * h * PANEL;
        for (int k = 0; k < h; k++) out[k] = p[k * PANEL + lane];
    }
}

/* HF "rotate half" RoPE of one head in place. */
static void rope(const Model* m, float* x, int64_t position) {
    int half = m->head_dim / 2;
    const float* cos = m->rope_cos + position * half;
    const float* sin = m->rope_sin + position * half;
    for (int i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

static inline void cache_put(const Model* m, void* cache, int64_t index, float value) {
    if (m->kv_type == KV_BF16) ((uint16_t*)cache)[index] = f32_to_bf16(value);
    else if (m->kv_type == KV_F16) ((uint16_t*)cache)[index] = f32_to_f16(value);
    else ((float*)cache)[index] = value;
}

/* LANES cache elements from index on, as fp32; kv_type a compile-time constant where inlined. */
static inline __attribute__((always_inline)) vf cache_load(const void* cache, int64_t index, const int kv_type) {
    if (kv_type == KV_BF16) return v_load_bf16((const uint16_t*)cache + index);
    if (kv_type == KV_F16) return v_load_f16((const uint16_t*)cache + index);
    return v_load((const float*)cache + index);
}

static inline const int32_t* slot_table(const Model* m, int slot) {
    return m->block_tables + (int64_t)slot * (m->max_len / KEY_BLOCK);
}

/* RoPE and the K/V writes of one chunk's tokens for KV head g, and RoPE of its G query heads. */
static void write_chunk_kv(const Forward* f, const Layer* layer, int chunk, int g) {
    const Model* m = f->m;
    const Batch* b = f->b;
    int d = m->head_dim, heads = m->num_heads, group = heads / m->num_kv_heads;
    int ldq = ldy_of(&layer->qkv);
    const int32_t* table = slot_table(m, b->chunk_slots[chunk]);
    int64_t head_base = (int64_t)g * m->pool_positions * d;  /* the same in K and V */
    for (int t = b->chunk_starts[chunk]; t < b->chunk_starts[chunk + 1]; t++) {
        int64_t p = b->positions[t];
        float* row = f->qkv + (int64_t)t * ldq;
        float* k = row + (heads + g) * d;
        const float* v = row + (heads + m->num_kv_heads + g) * d;
        rope(m, k, p);
        int64_t block_at = head_base + (int64_t)table[p / KEY_BLOCK] * KEY_BLOCK * d;
        int64_t k_at = block_at + p % KEY_BLOCK, v_at = block_at + (p % KEY_BLOCK) * d;
        for (int i = 0; i < d; i++) cache_put(m, layer->k_cache, k_at + (int64_t)i * KEY_BLOCK, k[i]);
        for (int i = 0; i < d; i++) cache_put(m, layer->v_cache, v_at + i, v[i]);
        for (int h = g * group; h < (g + 1) * group; h++) rope(m, row + h * d, p);
    }
}

/* Attention of NQ query heads that share a KV head, each over keys 0 .. its own position: one
   pass over K computes every query's scores from each K load, softmax per query, and one pass
   over V accumulates every query's output in registers. D (head_dim), NQ and the cache element
   type are compile-time constants in the specializations below, so the accumulators stay in
   registers: NQ * D / 16 <= 24 vectors. */
static inline __attribute__((always_inline)) void attend_queries(
    const void* k_cache, const void* v_cache, const int32_t* table, const float* const* queries,
    const int64_t* pos, float* scores, float* const* outs, const int d, const int nq, const int kv_type) {
    const float scale = 1.0f / sqrtf((float)d);
    int64_t last = 0;
    for (int q = 0; q < nq; q++) last = pos[q] > last ? pos[q] : last;
    int blocks = (int)(last / KEY_BLOCK) + 1, keys = blocks * KEY_BLOCK;
    vf top[nq];
    for (int q = 0; q < nq; q++) top[q] = v_splat(-INFINITY);
    for (int kb = 0; kb < blocks; kb++) {
        for (int h = 0; h < KEY_BLOCK / LANES; h++) {  /* one vector of keys at a time */
            vf s[nq];
            for (int q = 0; q < nq; q++) s[q] = v_splat(0.0f);
            int64_t at = (int64_t)table[kb] * d * KEY_BLOCK + h * LANES;
            for (int i = 0; i < d; i++) {
                vf k = cache_load(k_cache, at + i * KEY_BLOCK, kv_type);
                for (int q = 0; q < nq; q++) s[q] += v_splat(queries[q][i]) * k;
            }
            int first_key = kb * KEY_BLOCK + h * LANES;
            vi key = v_iota() + first_key;
            for (int q = 0; q < nq; q++) {
                /* keys past a query's position are later tokens, or stale entries of rolled-back drafts */
                vf masked = v_select(key > (int32_t)pos[q], v_splat(-INFINITY), s[q] * v_splat(scale));
                top[q] = v_maxv(top[q], masked);
                v_store(scores + (int64_t)q * keys + first_key, masked);
            }
        }
    }
    float inv[nq];
    for (int q = 0; q < nq; q++) {
        float* row = scores + (int64_t)q * keys;
        vf max = v_splat(v_max(top[q])), total = v_splat(0.0f);
        for (int j = 0; j < keys; j += LANES) {
            vf e = v_exp(v_load(row + j) - max);
            total += e;
            v_store(row + j, e);
        }
        inv[q] = 1.0f / v_sum(total);
    }
    vf acc[nq][d / LANES];
    for (int q = 0; q < nq; q++)
        for (int c = 0; c < d / LANES; c++) acc[q][c] = v_splat(0.0f);
    for (int kb = 0; kb < blocks; kb++) {
        int64_t block_at = (int64_t)table[kb] * KEY_BLOCK * d;
        int first = kb * KEY_BLOCK, count = last + 1 - first < KEY_BLOCK ? (int)(last + 1 - first) : KEY_BLOCK;
        for (int i = 0; i < count; i++) {
            int64_t at = block_at + (int64_t)i * d, j = first + i;
            for (int c = 0; c < d / LANES; c++) {
                vf v = cache_load(v_cache, at + c * LANES, kv_type);
                for (int q = 0; q < nq; q++) acc[q][c] += v_splat(scores[(int64_t)q * keys + j]) * v;
            }
        }
    }
    for (int q = 0; q < nq; q++)
        for (int c = 0; c < d / LANES; c++) v_store(outs[q] + c * LANES, acc[q][c] * v_splat(inv[q]));
}

typedef void (*attend_fn)(const void*, const void*, const int32_t*, const float* const*, const int64_t*, float*,
                          float* const*);
#define ATTEND(D, NQ, KV)                                                                            \
    static void attend_##D##_##NQ##_##KV(const void* k, const void* v, const int32_t* t,             \
                                         const float* const* q, const int64_t* pos, float* s,        \
                                         float* const* o) {                                          \
        attend_queries(k, v, t, q, pos, s, o, D, NQ, KV);                                            \
    }
#define ATTEND_TYPES(D, NQ) ATTEND(D, NQ, 0) ATTEND(D, NQ, 1) ATTEND(D, NQ, 2)
ATTEND_TYPES(64, 1) ATTEND_TYPES(64, 2) ATTEND_TYPES(64, 3) ATTEND_TYPES(64, 4) ATTEND_TYPES(64, 5)
ATTEND_TYPES(64, 6) ATTEND_TYPES(128, 1) ATTEND_TYPES(128, 2) ATTEND_TYPES(128, 3)
#if defined(__AVX512F__)
#define QUERIES_64 6      /* 6 x 4 accumulators: 24 of 32 zmm */
#define QUERIES_128 3
#else
#define QUERIES_64 1      /* AVX2 has half the registers, each vf taking two */
#define QUERIES_128 1
#endif
#define ATTEND_64(KV) {NULL, attend_64_1_##KV, attend_64_2_##KV, attend_64_3_##KV, attend_64_4_##KV, attend_64_5_##KV, \
                       attend_64_6_##KV}
#define ATTEND_128(KV) {NULL, attend_128_1_##KV, attend_128_2_##KV, attend_128_3_##KV}
static const attend_fn attend_64[3][7] = {ATTEND_64(0), ATTEND_64(1), ATTEND_64(2)};  /* [kv_type][queries] */
static const attend_fn attend_128[3][4] = {ATTEND_128(0), ATTEND_128(1), ATTEND_128(2)};

/* The most queries one attend call takes for this head_dim. */
static inline int queries_per_call(const Model* m) {
    return m->head_dim == 64 ? QUERIES_64 : m->head_dim == 128 ? QUERIES_128 : 1;
}

static void attend(const Model* m, const void* k, const void* v, const int32_t* table, const float* const* queries,
                   const int64_t* pos, int nq, float* scores, float* const* outs) {
    if (m->head_dim == 64) attend_64[m->kv_type][nq](k, v, table, queries, pos, scores, outs);
    else if (m->head_dim == 128) attend_128[m->kv_type][nq](k, v, table, queries, pos, scores, outs);
    else if (m->kv_type == KV_BF16) attend_queries(k, v, table, queries, pos, scores, outs, m->head_dim, 1, KV_BF16);
    else if (m->kv_type == KV_F16) attend_queries(k, v, table, queries, pos, scores, outs, m->head_dim, 1, KV_F16);
    else attend_queries(k, v, table, queries, pos, scores, outs, m->head_dim, 1, KV_F32);
}

/* One chunk's tokens for KV head g: write their K and V, then attend with the group's query heads,
   up to queries_per_call of the chunk's (token, head) queries at a time. `scores` holds that many
   rows of max_len, `out` as many head outputs. */
static void attention_item(const Forward* f, const Layer* layer, int chunk, int g, float* scores, float* out) {
    const Model* m = f->m;
    const Batch* b = f->b;
    int d = m->head_dim, heads = m->num_heads, group = heads / m->num_kv_heads, width = heads * d;
    int ldq = ldy_of(&layer->qkv), elem = m->kv_type == KV_F32 ? 4 : 2, per_call = queries_per_call(m);
    int64_t head_bytes = (int64_t)g * m->pool_positions * d * elem;
    const char* k_cache = (const char*)layer->k_cache + head_bytes;
    const char* v_cache = (const char*)layer->v_cache + head_bytes;
    const int32_t* table = slot_table(m, b->chunk_slots[chunk]);
    write_chunk_kv(f, layer, chunk, g);
    int t0 = b->chunk_starts[chunk], total = (b->chunk_starts[chunk + 1] - t0) * group;
    const float* queries[QUERIES_64];
    float* outs[QUERIES_64];
    int64_t pos[QUERIES_64];
    for (int first = 0; first < total; first += per_call) {
        int nq = total - first < per_call ? total - first : per_call;
        for (int q = 0; q < nq; q++) {
            int t = t0 + (first + q) / group, h = g * group + (first + q) % group;
            queries[q] = f->qkv + (int64_t)t * ldq + h * d;
            pos[q] = b->positions[t];
            outs[q] = out + q * d;
        }
        attend(m, k_cache, v_cache, table, queries, pos, nq, scores, outs);
        for (int q = 0; q < nq; q++) {
            int t = t0 + (first + q) / group, h = g * group + (first + q) % group;
            if (m->weights_kind == WEIGHTS_F32) memcpy(f->attn + (int64_t)t * width + h * d, outs[q], sizeof(float) * d);
            else put_input_at(m, f->gin, t, width, h * d, outs[q], d);
        }
    }
}

static void attention_phase(const Forward* f, const Layer* layer, int tid, int nt) {
    const Model* m = f->m;
    int items = f->b->num_chunks * m->num_kv_heads, begin, end;
    share(items, tid, nt, &begin, &end);
    float* scores = f->scratch + (int64_t)tid * f->scratch_floats;
    float* out = scores + (int64_t)QUERIES_64 * m->max_len;
    for (int item = begin; item < end; item++)
        attention_item(f, layer, item / m->num_kv_heads, item % m->num_kv_heads, scores, out);
}

/* This thread's panels of w: whole tiles of WIDE_PANELS where it can. */
static void gemm_share(const Forward* f, const void* x, int rows, const PackedMatrix* w, float* y,
                       int tid, int nt, int* p0, int* p1) {
    int groups = (w->panels + WIDE_PANELS - 1) / WIDE_PANELS, g0, g1;
    share(groups, tid, nt, &g0, &g1);
    *p0 = g0 * WIDE_PANELS;
    *p1 = g1 * WIDE_PANELS < w->panels ? g1 * WIDE_PANELS : w->panels;
    gemm_range(x, rows, w, f->m->weights_kind, *p0, *p1, y, ldy_of(w));
}

static void qkv_phase(const Forward* f, const Layer* layer, int tid, int nt) {
    int p0, p1, ldq = ldy_of(&layer->qkv);
    gemm_share(f, f->gin, f->b->num_tokens, &layer->qkv, f->qkv, tid, nt, &p0, &p1);
    if (layer->qkv_bias == NULL) return;
    int c1 = p1 * PANEL < layer->qkv.rows ? p1 * PANEL : layer->qkv.rows;
    for (int t = 0; t < f->b->num_tokens; t++)
        for (int c = p0 * PANEL; c < c1; c++) f->qkv[(int64_t)t * ldq + c] += layer->qkv_bias[c];
}

/* hidden += y (the previous projection, unless first), then the normed rows as the next input. */
static void residual_norm_phase(const Forward* f, const float* norm, int add_y, int ldy, int tid, int nt) {
    const Model* m = f->m;
    int h = m->hidden, begin, end;
    share(f->b->num_tokens, tid, nt, &begin, &end);
    float normed[h];
    for (int t = begin; t < end; t++) {
        float* row = f->hidden + (int64_t)t * h;
        if (add_y)
            for (int i = 0; i < h; i++) row[i] += f->y[(int64_t)t * ldy + i];
        rms_norm(row, norm, h, m->eps, normed);
        put_input(m, f->gin, t, h, normed);
    }
}

/* Copies this thread's rows of the residual stream entering layer l into captured, if l is listed. */
static void capture_phase(const Forward* f, int l, int tid, int nt) {
    const Batch* b = f->b;
    int which = -1, h = f->m->hidden, begin, end;
    for (int i = 0; i < b->num_capture; i++)
        if (b->capture_layers[i] == l) which = i;
    if (which < 0) return;
    share(b->num_tokens, tid, nt, &begin, &end);
    for (int t = begin; t < end; t++)
        memcpy(b->captured + ((int64_t)t * b->num_capture + which) * h, f->hidden + (int64_t)t * h, sizeof(float) * h);
}

static void silu_mul_phase(const Forward* f, const Layer* layer, int tid, int nt) {
    const Model* m = f->m;
    int inter = m->intermediate, ld = ldy_of(&layer->gate_up), begin, end;
    share(f->b->num_tokens, tid, nt, &begin, &end);
    float act[inter + LANES];
    for (int t = begin; t < end; t++) {
        const float* gate = f->gate_up + (int64_t)t * ld;
        const float* up = gate + inter;
        int i = 0;
        for (; i + LANES <= inter; i += LANES) {
            vf g = v_load(gate + i);
            v_store(act + i, g / (v_splat(1.0f) + v_exp(-g)) * v_load(up + i));
        }
        for (; i < inter; i++) act[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
        put_input(m, f->gin, t, inter, act);
    }
}

static void final_phase(Forward* f, int tid, int nt, int* sense) {
    const Model* m = f->m;
    const Batch* b = f->b;
    int h = m->hidden, begin, end, ld_down = ldy_of(&m->layers[m->num_layers - 1].down);
    share(b->num_out, tid, nt, &begin, &end);
    float normed[h];
    for (int i = begin; i < end; i++) {
        int t = b->out_tokens[i];
        float* row = f->hidden + (int64_t)t * h;
        const float* y = f->y + (int64_t)t * ld_down;
        float sum[h];
        for (int k = 0; k < h; k++) sum[k] = row[k] + y[k];
        rms_norm(sum, m->final_norm, h, m->eps, normed);
        if (b->want_hidden) memcpy(b->out + (int64_t)i * h, normed, sizeof(float) * h);
        else put_input(m, f->gin, i, h, normed);
    }
    if (b->want_hidden) return;
    barrier_wait(&f->barrier, nt, sense);
    int p0, p1;
    gemm_share(f, f->gin, b->num_out, &m->lm_head, b->out, tid, nt, &p0, &p1);
}

static void forward_job(void* arg, int tid, int nt) {
    Forward* f = arg;
    const Model* m = f->m;
    const Batch* b = f->b;
    int sense = 0, begin, end;
    share(b->num_tokens, tid, nt, &begin, &end);
    for (int t = begin; t < end; t++) embed_row(m, b->token_ids[t], f->hidden + (int64_t)t * m->hidden);
    barrier_wait(&f->barrier, nt, &sense);
    for (int l = 0; l < m->num_layers; l++) {
        const Layer* layer = &m->layers[l];
        int p0, p1;
        int ld_prev = l ? ldy_of(&m->layers[l - 1].down) : 0;
        residual_norm_phase(f, layer->attn_norm, l > 0, ld_prev, tid, nt);
        capture_phase(f, l, tid, nt);  /* the same rows residual_norm_phase just wrote: no barrier */
        barrier_wait(&f->barrier, nt, &sense);
        qkv_phase(f, layer, tid, nt);
        barrier_wait(&f->barrier, nt, &sense);
        attention_phase(f, layer, tid, nt);
        barrier_wait(&f->barrier, nt, &sense);
        gemm_share(f, m->weights_kind == WEIGHTS_F32 ? (const void*)f->attn : f->gin, b->num_tokens, &layer->o, f->y, tid, nt, &p0, &p1);
        barrier_wait(&f->barrier, nt, &sense);
        residual_norm_phase(f, layer->mlp_norm, 1, ldy_of(&layer->o), tid, nt);
        barrier_wait(&f->barrier, nt, &sense);
        gemm_share(f, f->gin, b->num_tokens, &layer->gate_up, f->gate_up, tid, nt, &p0, &p1);
        barrier_wait(&f->barrier, nt, &sense);
        silu_mul_phase(f, layer, tid, nt);
        barrier_wait(&f->barrier, nt, &sense);
        gemm_share(f, f->gin, b->num_tokens, &layer->down, f->y, tid, nt, &p0, &p1);
        barrier_wait(&f->barrier, nt, &sense);
    }
    final_phase(f, tid, nt, &sense);
}

static int64_t max_i64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Returns the number of threads used, or -1 when memory ran out. */
int tandem_forward(const Model* m, const Batch* b, int num_threads) {
    int64_t t = b->num_tokens, rows = max_i64(t, b->num_out);
    const Layer* first = &m->layers[0];
    int64_t widest = max_i64(max_i64(m->hidden, m->intermediate), (int64_t)m->num_heads * m->head_dim);
    Forward f = {.m = m, .b = b};
    f.scratch_floats = (int64_t)QUERIES_64 * (m->max_len + m->head_dim) + LANES;
    int64_t sizes[] = {
        t * m->hidden, rows * widest, t * ldy_of(&first->qkv), t * m->num_heads * m->head_dim,
        t * max_i64(ldy_of(&first->o), ldy_of(&first->down)), t * ldy_of(&first->gate_up),
        f.scratch_floats * num_threads,
    };
    float* parts[7];
    int ok = 1;
    for (int i = 0; i < 7; i++) ok &= (parts[i] = malloc(sizeof(float) * (sizes[i] + LANES))) != NULL;
    if (ok) {
        f.hidden = parts[0], f.gin = parts[1], f.qkv = parts[2], f.attn = parts[3];
        f.y = parts[4], f.gate_up = parts[5], f.scratch = parts[6];
        num_threads = pool_run(forward_job, &f, num_threads);
    }
    for (int i = 0; i < 7; i++) free(parts[i]);
    return ok ? num_threads : -1;
}

typedef struct {
    const void* x;
    int rows;
    const PackedMatrix* w;
    int kind;
    float* y;
    int ldy;
} GemmJob;

static void gemm_job(void* arg, int tid, int nt) {
    const GemmJob* j = arg;
    int groups = (j->w->panels + WIDE_PANELS - 1) / WIDE_PANELS, g0, g1;
    share(groups, tid, nt, &g0, &g1);
    int p1 = g1 * WIDE_PANELS < j->w->panels ? g1 * WIDE_PANELS : j->w->panels;
    gemm_range(j->x, j->rows, j->w, j->kind, g0 * WIDE_PANELS, p1, j->y, j->ldy);
}

/* y[rows, ldy] = x @ W^T over all of W's panels; x in the weights' element type (bf16 pairs), or
   fp32 for block rows, quantized here. Returns -1 when memory ran out, else 0. */
int tandem_gemm(const void* x, int rows, const PackedMatrix* w, int kind, float* y, int ldy, int num_threads) {
    void* blocks = NULL;
    if (is_blocks(kind)) {
        int per_row = w->cols / QBLOCK, x8 = kind == WEIGHTS_BLOCKS_X8;
        if ((blocks = malloc(xblock_bytes(x8) * ((int64_t)rows * per_row + 1))) == NULL) return -1;
        for (int r = 0; r < rows; r++) {
            const float* row = (const float*)x + (int64_t)r * w->cols;
            if (x8) quantize_row8(row, w->cols, (XBlock8*)blocks + (int64_t)r * per_row);
            else quantize_row(row, w->cols, (XBlock*)blocks + (int64_t)r * per_row);
        }
        x = blocks;
    }
    GemmJob job = {x, rows, w, kind, y, ldy};
    pool_run(gemm_job, &job, num_threads);
    free(blocks);
    return 0;
}

/* Call once before anything else: 0 when this build can run here. AMX needs the kernel's leave to
   use its tile registers (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA), once per process. */
int tandem_init(void) {
#if defined(__AMX_BF16__)
    return (int)syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */);
#else
    return 0;
#endif
}

/* Rows per BlockGroup: the block kernels' vector lanes (blocks.h). */
int tandem_group_rows(void) { return GROUP_ROWS; }

/* What this build uses: bit 0 AVX-512, bit 1 AVX-512 BF16, bit 2 AMX. */
int tandem_features(void) {
    int features = 0;
#if defined(__AVX512F__)
    features |= 1;
#endif
#if defined(__AVX512BF16__)
    features |= 2;
#endif
#if defined(__AMX_BF16__)
    features |= 4;
#endif
    return features;
}

/* The index of the first maximum of each row of x [rows, cols] (fp32, rows ld apart), as
   torch.argmax gives it, NaN counting as the maximum. The greedy path's only use of the logits. */
static int64_t argmax_row(const float* row, int cols) {
    vf best = v_splat(-INFINITY);
    vi at = v_splat_i(-1), nan_seen = v_splat_i(0);
    int c = 0;
    for (; c + LANES <= cols; c += LANES) {
        vf v = v_load(row + c);
        vi better = v > best;
        best = v_select(better, v, best);
        at = (better & (v_iota() + c)) | (~better & at);
        nan_seen |= v != v;
    }
    int64_t index = 0;  /* all -inf: torch says 0 */
    float top = row[0];
    int any_nan = 0;
    for (int lane = 0; lane < LANES; lane++) {  /* the first index among the lanes' maxima */
        any_nan |= nan_seen[lane];
        if (at[lane] >= 0 && (best[lane] > top || (best[lane] == top && at[lane] < index)))
            top = best[lane], index = at[lane];
    }
    for (; c < cols; c++) {
        any_nan |= row[c] != row[c];
        if (row[c] > top) top = row[c], index = c;
    }
    if (any_nan)
        for (int i = 0; i < cols; i++)
            if (row[i] != row[i]) return i;
    return index;
}

void tandem_argmax(const float* x, int rows, int cols, int ld, int64_t* out) {
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + (int64_t)r * ld, cols);
}
