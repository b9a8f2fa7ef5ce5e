// The seed's algorithms with the seed's containers, for side-by-side measurement only.
#include "kvc_baseline.h"

#include <algorithm>
#include <bitset>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <vector>

namespace {

struct cells_t {
    std::vector<int32_t> pos, shift;
    std::vector<std::bitset<64>> seq;
    std::set<uint32_t> used;
    std::set<int32_t> seq_pos[64];

    void resize(uint32_t n) {
        pos.assign(n, -1);
        shift.assign(n, 0);
        seq.assign(n, std::bitset<64>());
        used.clear();
        for (auto &s : seq_pos) s.clear();
    }
    uint32_t size() const { return (uint32_t)pos.size(); }
    bool is_empty(uint32_t i) const { return pos[i] == -1; }
    uint32_t used_max_p1() const { return used.empty() ? 0 : *used.rbegin() + 1; }
    bool pos_in(uint32_t i, int32_t p0, int32_t p1) const { return pos[i] >= p0 && pos[i] < p1; }
    void seq_pos_rm(uint32_t i) {
        for (int s = 0; s < 64; ++s) if (seq[i].test(s)) seq_pos[s].erase(pos[i]);
    }
    void seq_pos_add(uint32_t i) {
        for (int s = 0; s < 64; ++s) if (seq[i].test(s)) seq_pos[s].insert(pos[i]);
    }
    void pos_set(uint32_t i, int32_t p) { pos[i] = p; used.insert(i); }
    void seq_add(uint32_t i, int32_t s) { seq[i].set(s); seq_pos[s].insert(pos[i]); }
    bool seq_rm(uint32_t i, int32_t s) {
        seq[i].reset(s);
        seq_pos[s].erase(pos[i]);
        if (seq[i].none()) { pos[i] = -1; used.erase(i); return true; }
        return false;
    }
    void mv(uint32_t a, uint32_t b) {
        pos[b] = pos[a]; shift[b] = shift[a]; seq[b] = seq[a];
        pos[a] = -1; shift[a] = 0; seq[a].reset();
        used.erase(a); used.insert(b);
    }
};

struct recovery_t {
    uint32_t i;
    cells_t cells;
};

}  // namespace

struct kvb_cache {
    cells_t cells;
    uint32_t head = 0, n = 0, n_pad, n_swa;
    int32_t swa_type;
    bool v_trans;
    std::vector<recovery_t> rec;
    std::vector<uint32_t> ids;
    std::vector<kvb_layer> layers;

    bool masked_swa(int32_t p0, int32_t p1) const {
        if (swa_type == 1) return p1 - p0 >= (int32_t)n_swa;
        if (swa_type == 2) return p0 < (p1 / (int32_t)n_swa) * (int32_t)n_swa;
        return false;
    }
};

namespace {
// The seed's io.write: bounds-checked appends, one call per piece.
struct writer {
    uint8_t *p; size_t cap, n = 0;
    void write(const void *src, size_t len) {
        if (n + len <= cap) std::memcpy(p + n, src, len);
        n += len;
    }
};
struct reader {
    const uint8_t *p; size_t len, n = 0; bool bad = false;
    const uint8_t *read(size_t k) {
        if (n + k > len) { bad = true; return nullptr; }
        const uint8_t *r = p + n; n += k; return r;
    }
    template <class T> bool read_to(T *dst) {
        const uint8_t *r = read(sizeof(T));
        if (!r) return false;
        std::memcpy(dst, r, sizeof(T));
        return true;
    }
};
}  // namespace

extern "C" {

kvb_cache *kvb_new(uint32_t size, uint32_t n_pad, uint32_t n_swa, int32_t swa_type, int v_trans) {
    kvb_cache *c = new kvb_cache();
    c->cells.resize(size);
    c->n_pad = n_pad;
    c->n_swa = n_swa;
    c->swa_type = swa_type;
    c->v_trans = v_trans != 0;
    return c;
}

void kvb_free(kvb_cache *c) { delete c; }

void kvb_set_layers(kvb_cache *c, uint32_t n_layer, const kvb_layer *layers) {
    c->layers.assign(layers, layers + n_layer);
}

uint32_t kvb_head(const kvb_cache *c) { return c->head; }
uint32_t kvb_n(const kvb_cache *c) { return c->n; }
uint32_t kvb_used(const kvb_cache *c) { return (uint32_t)c->cells.used.size(); }
uint32_t kvb_size(const kvb_cache *c) { return c->cells.size(); }

void kvb_cells(const kvb_cache *c, int32_t *pos, uint64_t *seq) {
    for (uint32_t i = 0; i < c->cells.size(); ++i) {
        pos[i] = c->cells.pos[i];
        seq[i] = c->cells.seq[i].to_ullong();
    }
}

uint32_t kvb_defrag_ids(const kvb_cache *c, uint32_t *ids) {
    if (ids) std::copy(c->ids.begin(), c->ids.end(), ids);
    return (uint32_t)c->ids.size();
}

int kvb_find_slot(kvb_cache *c, uint32_t n_tokens, const int32_t *pos, const int32_t *seq) {
    cells_t &cells = c->cells;
    if (c->head > cells.used.size() + 2 * n_tokens) c->head = 0;
    if (n_tokens > cells.size()) return 0;
    uint32_t n_tested = 0;
    while (true) {
        if (c->head + n_tokens > cells.size()) {
            n_tested += cells.size() - c->head;
            c->head = 0;
            continue;
        }
        bool found = true;
        for (uint32_t i = 0; i < n_tokens; i++) {
            if (!cells.is_empty(c->head + i)) {
                found = false;
                c->head += i + 1;
                n_tested += i + 1;
                break;
            }
        }
        if (found) break;
        if (n_tested >= cells.size()) return 0;
    }
    // the recovery snapshot, allocated per call as the seed does
    recovery_t r;
    r.i = c->head;
    r.cells.resize(n_tokens);
    for (uint32_t j = 0; j < n_tokens; ++j) {
        r.cells.pos[j] = cells.pos[c->head + j];
        r.cells.seq[j] = cells.seq[c->head + j];
    }
    c->rec.push_back(std::move(r));
    for (uint32_t i = 0; i < n_tokens; ++i) {
        cells.pos_set(c->head + i, pos[i]);
        cells.seq_add(c->head + i, seq[i]);
    }
    const uint32_t p1 = cells.used_max_p1();
    const uint32_t padded = ((p1 + c->n_pad - 1) / c->n_pad) * c->n_pad;
    c->n = std::min(cells.size(), std::max(c->n_pad, padded));
    return 1;
}

void kvb_commit(kvb_cache *c) { c->rec.clear(); }

void kvb_store(kvb_cache *c, uint32_t il, uint32_t n_tokens, const uint8_t *k, const uint8_t *v) {
    const kvb_layer &l = c->layers[il];
    const size_t head = c->head, size = c->cells.size();
    std::memcpy(l.k + head * l.k_row_bytes, k, (size_t)n_tokens * l.k_row_bytes);
    if (!c->v_trans) {
        std::memcpy(l.v + head * l.v_row_bytes, v, (size_t)n_tokens * l.v_row_bytes);
        return;
    }
    // ggml_cpy into the transposed view: element e of token t to row e, column head + t
    const size_t el = l.v_el_bytes;
    for (uint32_t t = 0; t < n_tokens; ++t)
        for (uint32_t e = 0; e < l.n_embd_v; ++e)
            std::memcpy(l.v + ((size_t)e * size + head + t) * el, v + ((size_t)t * l.n_embd_v + e) * el, el);
}

int kvb_step(kvb_cache *c, uint32_t n_tokens, const int32_t *pos, const int32_t *seq,
             const uint8_t *const *k_rows, const uint8_t *const *v_rows, float *mask) {
    // the simple split's ubatch: token order ids, then per-token pos / n_seq_id / seq_id / output
    std::vector<int64_t> ids(n_tokens);
    for (uint32_t i = 0; i < n_tokens; ++i) ids[i] = i;
    std::vector<int32_t> u_pos(n_tokens), u_n_seq_id(n_tokens), u_seq(n_tokens);
    std::vector<const int32_t *> u_seq_id(n_tokens);
    std::vector<int8_t> u_output(n_tokens);
    for (uint32_t i = 0; i < n_tokens; ++i) {
        const int64_t t = ids[i];
        u_pos[i] = pos[t];
        u_n_seq_id[i] = 1;
        u_seq[i] = seq[t];
        u_seq_id[i] = &u_seq[i];
        u_output[i] = i + 1 == n_tokens;
    }
    if (!kvb_find_slot(c, n_tokens, u_pos.data(), u_seq.data())) return 0;
    for (uint32_t il = 0; il < c->layers.size(); ++il) kvb_store(c, il, n_tokens, k_rows[il], v_rows[il]);
    kvb_kq_mask(c, n_tokens, u_pos.data(), u_seq.data(), 1, mask);
    kvb_commit(c);
    return 1;
}

int kvb_seq_rm(kvb_cache *c, int32_t s, int32_t p0, int32_t p1) {
    cells_t &cells = c->cells;
    uint32_t new_head = cells.size();
    if (p0 < 0) p0 = 0;
    if (p1 < 0) p1 = std::numeric_limits<int32_t>::max();
    for (uint32_t i = 0; i < cells.size(); ++i) {
        if (!cells.pos_in(i, p0, p1)) continue;
        if (cells.seq[i].test(s) && cells.seq_rm(i, s)) {
            if (new_head == cells.size()) new_head = i;
        }
    }
    if (new_head != cells.size() && new_head < c->head) c->head = new_head;
    return 1;
}

int32_t kvb_seq_pos_max(const kvb_cache *c, int32_t s) {
    return c->cells.seq_pos[s].empty() ? -1 : *c->cells.seq_pos[s].rbegin();
}

void kvb_kq_mask(const kvb_cache *c, uint32_t n_tokens, const int32_t *pos, const int32_t *seq, int causal, float *out) {
    const cells_t &cells = c->cells;
    const int64_t n_kv = c->n;
    for (uint32_t j = 0; j < n_tokens; ++j) {
        const int32_t p1 = pos[j];
        for (int64_t i = 0; i < n_kv; ++i) {
            float f = 0.0f;
            bool masked = false;
            if (cells.is_empty((uint32_t)i)) {
                masked = true;
            } else {
                const int32_t p0 = cells.pos[i];
                masked = masked || !cells.seq[i].test(seq[j]);
                masked = masked || (causal && p0 > p1);
                masked = masked || c->masked_swa(p0, p1);
            }
            if (masked) f = -INFINITY;
            out[j * n_kv + i] = f;
        }
    }
    const uint32_t rows = ((n_tokens + 63) / 64) * 64;
    for (uint32_t i = n_tokens; i < rows; ++i)
        for (int64_t j = 0; j < n_kv; ++j) out[i * n_kv + j] = -INFINITY;
}

int kvb_defrag_prepare(kvb_cache *c, int32_t n_max_nodes, uint32_t n_layer) {
    cells_t &cells = c->cells;
    const uint32_t n_kv = cells.used_max_p1();
    const uint32_t n_used = (uint32_t)cells.used.size();
    uint32_t n_moves = 0;
    const uint32_t max_moves = (n_max_nodes - 2 * n_layer) / (6 * n_layer);
    auto &ids = c->ids;
    ids.clear();
    ids.resize(n_kv, n_kv);
    for (uint32_t i0 = 0; i0 < n_used; ++i0) {
        if (!cells.is_empty(i0)) { ids[i0] = i0; continue; }
        uint32_t nh = 1;
        while (i0 + nh < n_used && cells.is_empty(i0 + nh)) nh++;
        uint32_t nf = 0;
        uint32_t is = n_kv - 1;
        for (; is > i0; --is) {
            if (cells.is_empty(is) || ids[is] != n_kv) continue;
            nf++;
            if (nf == nh) break;
        }
        if (nf != nh) return -1;
        nf = 0;
        uint32_t i1 = is;
        bool cont = false, stop = false;
        for (; i1 < n_kv; ++i1) {
            if (cells.is_empty(i1) || ids[i1] != n_kv) {
                if (n_moves == max_moves) { stop = true; break; }
                cont = false;
                continue;
            }
            ids[i1] = i0 + nf;
            cells.mv(i1, i0 + nf);
            c->head = n_used;
            if (!cont) { n_moves++; cont = true; }
            nf++;
            if (nf == nh) break;
        }
        if (stop || n_moves == max_moves) break;
        i0 += nh - 1;
    }
    return n_moves > 0;
}


size_t kvb_state_write(const kvb_cache *c, int32_t seq_id, uint8_t *out, size_t cap) {
    const cells_t &cells = c->cells;
    std::vector<std::pair<uint32_t, uint32_t>> ranges;
    uint32_t cell_count = 0, begin = cells.size();
    for (uint32_t i = 0; i < cells.size(); ++i) {
        if (!cells.is_empty(i) && (seq_id == -1 || cells.seq[i].test(seq_id))) {
            ++cell_count;
            if (begin == cells.size()) begin = i;
        } else if (begin != cells.size()) {
            ranges.emplace_back(begin, i);
            begin = cells.size();
        }
    }
    if (begin != cells.size()) ranges.emplace_back(begin, cells.size());
    writer io{out, cap};
    io.write(&cell_count, 4);
    for (auto &r : ranges) {
        for (uint32_t i = r.first; i < r.second; ++i) {
            std::vector<int32_t> ids;
            for (int32_t s = 0; s < 64; ++s)
                if ((s == seq_id || seq_id == -1) && cells.seq[i].test(s)) ids.push_back(s);
            const int32_t p = cells.pos[i];
            const uint32_t n = (uint32_t)ids.size();
            io.write(&p, 4);
            io.write(&n, 4);
            for (int32_t s : ids) io.write(&s, 4);
        }
    }
    const uint32_t v_trans = c->v_trans, n_layer = (uint32_t)c->layers.size();
    io.write(&v_trans, 4);
    io.write(&n_layer, 4);
    for (auto &l : c->layers) {
        const uint64_t row = l.k_row_bytes;
        io.write(&l.type_k, 4);
        io.write(&row, 8);
        for (auto &r : ranges) io.write(l.k + r.first * row, (r.second - r.first) * row);
    }
    for (auto &l : c->layers) {
        io.write(&l.type_v, 4);
        if (!c->v_trans) {
            const uint64_t row = l.v_row_bytes;
            io.write(&row, 8);
            for (auto &r : ranges) io.write(l.v + r.first * row, (r.second - r.first) * row);
        } else {
            io.write(&l.v_el_bytes, 4);
            io.write(&l.n_embd_v, 4);
            for (uint32_t j = 0; j < l.n_embd_v; ++j)
                for (auto &r : ranges)
                    io.write(l.v + ((size_t)r.first + (size_t)j * cells.size()) * l.v_el_bytes,
                             (r.second - r.first) * l.v_el_bytes);
        }
    }
    return io.n;
}

int kvb_state_read(kvb_cache *c, int32_t seq_id, const uint8_t *data, size_t len) {
    // whole-cache restore only (what the benchmark measures)
    (void)seq_id;
    cells_t &cells = c->cells;
    reader io{data, len};
    uint32_t cell_count;
    if (!io.read_to(&cell_count) || cell_count > cells.size()) return 0;
    // the seed's clear(): the cells reset, head 0 and every K/V buffer zeroed
    cells.resize(cells.size());
    c->head = 0;
    for (auto &l : c->layers) {
        std::memset(l.k, 0, (size_t)cells.size() * l.k_row_bytes);
        std::memset(l.v, 0, c->v_trans ? (size_t)cells.size() * l.n_embd_v * l.v_el_bytes
                                        : (size_t)cells.size() * l.v_row_bytes);
    }
    for (uint32_t i = 0; i < cell_count; ++i) {
        int32_t p; uint32_t n;
        if (!io.read_to(&p) || !io.read_to(&n)) return 0;
        cells.pos_set(i, p);
        for (uint32_t j = 0; j < n; ++j) {
            int32_t s;
            if (!io.read_to(&s) || s < 0 || s >= 64) return 0;
            cells.seq_add(i, s);
        }
    }
    c->head = 0;
    uint32_t v_trans, n_layer;
    if (!io.read_to(&v_trans) || !io.read_to(&n_layer) || n_layer != c->layers.size()) return 0;
    for (auto &l : c->layers) {
        int32_t t; uint64_t row;
        if (!io.read_to(&t) || !io.read_to(&row) || row != l.k_row_bytes) return 0;
        const uint8_t *src = io.read(cell_count * row);
        if (!src) return 0;
        std::memcpy(l.k, src, cell_count * row);
    }
    for (auto &l : c->layers) {
        int32_t t;
        if (!io.read_to(&t)) return 0;
        if (!c->v_trans) {
            uint64_t row;
            if (!io.read_to(&row) || row != l.v_row_bytes) return 0;
            const uint8_t *src = io.read(cell_count * row);
            if (!src) return 0;
            std::memcpy(l.v, src, cell_count * row);
        } else {
            uint32_t el, ne;
            if (!io.read_to(&el) || !io.read_to(&ne) || ne != l.n_embd_v) return 0;
            for (uint32_t j = 0; j < ne; ++j) {
                const uint8_t *src = io.read(cell_count * el);
                if (!src) return 0;
                std::memcpy(l.v + (size_t)j * cells.size() * el, src, cell_count * el);
            }
        }
    }
    return 1;
}

}  // extern "C"
