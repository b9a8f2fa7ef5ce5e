// Today's llama.cpp cache loops with its containers, for side-by-side measurement only.
#include "kvc_baseline2026.h"

#include <algorithm>
#include <bitset>
#include <climits>
#include <cmath>
#include <limits>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using seq_set_t = std::bitset<KVB26_MAX_SEQ>;

// llama_kv_cells: one stream's cells
struct cells26_t {
    std::vector<int32_t> pos, shift;
    std::vector<seq_set_t> seq;
    std::set<uint32_t> used;
    std::set<std::pair<int32_t, uint32_t>> seq_pos[KVB26_MAX_SEQ];

    void resize(uint32_t n) {
        pos.assign(n, -1);
        shift.assign(n, 0);
        seq.assign(n, seq_set_t());
        used.clear();
        for (auto &s : seq_pos) s.clear();
    }
    uint32_t size() const { return (uint32_t)pos.size(); }
    bool is_empty(uint32_t i) const { return pos[i] == -1; }
    uint32_t get_used() const { return (uint32_t)used.size(); }
    uint32_t used_max_p1() const { return used.empty() ? 0 : *used.rbegin() + 1; }
    int seq_count(uint32_t i) const { return (int)seq[i].count(); }
    bool seq_has(uint32_t i, int32_t s) const { return seq[i].test(s); }
    int32_t seq_get(uint32_t i) const {
        for (int s = 0; s < KVB26_MAX_SEQ; ++s)
            if (seq[i].test(s)) return s;
        return -1;
    }
    int32_t seq_pos_min(int32_t s) const { return seq_pos[s].empty() ? -1 : seq_pos[s].begin()->first; }
    int32_t seq_pos_max(int32_t s) const { return seq_pos[s].empty() ? -1 : seq_pos[s].rbegin()->first; }
    bool pos_in(uint32_t i, int32_t p0, int32_t p1) const { return pos[i] >= p0 && pos[i] < p1; }
    void seq_pos_rm(uint32_t i) {
        for (int s = 0; s < KVB26_MAX_SEQ; ++s)
            if (seq[i].test(s)) seq_pos[s].erase({pos[i], i});
    }
    void rm(uint32_t i) {
        seq_pos_rm(i);
        seq[i].reset();
        pos[i] = -1;
        shift[i] = 0;
        used.erase(i);
    }
    bool seq_rm(uint32_t i, int32_t s) {
        seq[i].reset(s);
        seq_pos[s].erase({pos[i], i});
        if (seq[i].none()) {
            pos[i] = -1;
            shift[i] = 0;
            used.erase(i);
            return true;
        }
        return false;
    }
    void pos_set(uint32_t i, int32_t p) { pos[i] = p; used.insert(i); }
    void seq_add(uint32_t i, int32_t s) { seq[i].set(s); seq_pos[s].insert({pos[i], i}); }
};

// the slot of one ubatch: per token group its stream and cells
struct slot26_t {
    std::vector<uint32_t> strm;
    std::vector<std::vector<uint32_t>> idxs;
};

}  // namespace

struct kvb26_cache {
    std::vector<cells26_t> cells;   // one per stream
    std::vector<uint32_t> heads;
    std::vector<uint32_t> seq_to_stream;
    uint32_t n_pad, n_swa;
    int32_t swa_type;
    slot26_t last;
    bool have_last = false;

    bool is_masked_swa(int32_t p0, int32_t p1) const {
        if (swa_type == 1) return p1 - p0 >= (int32_t)n_swa;
        if (swa_type == 2) return p0 < (p1 / (int32_t)n_swa) * (int32_t)n_swa;
        return false;
    }
    uint32_t n_stream() const { return (uint32_t)cells.size(); }
    bool seq_rm(int32_t s, int32_t p0, int32_t p1);
};

namespace {

// The ubatch as llama.cpp's find_slot sees it: the token groups (one per sequence with several
// streams, one of every token otherwise) and each group's first token. false: not a valid ubatch.
bool groups_of(const kvb26_cache *c, uint32_t n_tokens, const uint32_t *seq_off, const int32_t *seq_ids,
               std::vector<int32_t> &unq, uint32_t &n_tps) {
    unq.clear();
    if (n_tokens == 0) return false;
    for (uint32_t t = 0; t < n_tokens; ++t) {
        if (seq_off[t + 1] <= seq_off[t]) return false;
        for (uint32_t k = seq_off[t]; k < seq_off[t + 1]; ++k)
            if (seq_ids[k] < 0 || (uint32_t)seq_ids[k] >= c->seq_to_stream.size()) return false;
    }
    if (c->n_stream() == 1) {
        unq.push_back(seq_ids[seq_off[0]]);
        n_tps = n_tokens;
        return true;
    }
    for (uint32_t t = 0; t < n_tokens; ++t) {
        const int32_t s = seq_ids[seq_off[t]];
        if (std::find(unq.begin(), unq.end(), s) == unq.end()) unq.push_back(s);
    }
    if (n_tokens % unq.size()) return false;
    n_tps = n_tokens / (uint32_t)unq.size();
    for (uint32_t g = 0; g < unq.size(); ++g)
        for (uint32_t ii = 0; ii < n_tps; ++ii) {
            const uint32_t t = g * n_tps + ii;
            if (seq_off[t + 1] - seq_off[t] != 1 || seq_ids[seq_off[t]] != unq[g]) return false;
        }
    return true;
}

// find_slot(ubatch, cont=false): the usable cells of each group, one at a time from the head
bool find_slot26(const kvb26_cache *c, const std::vector<int32_t> &unq, uint32_t n_tokens, slot26_t &res) {
    const uint32_t n_seqs = (uint32_t)unq.size();
    res.strm.assign(n_seqs, 0);
    res.idxs.assign(n_seqs, {});
    for (uint32_t s = 0; s < n_seqs; ++s) {
        const uint32_t strm = c->seq_to_stream[unq[s]];
        res.strm[s] = strm;
        res.idxs[s].reserve(n_tokens);
        const cells26_t &cells = c->cells[strm];
        uint32_t head_cur = c->heads[strm];
        if (head_cur > cells.get_used() + 2 * n_tokens) head_cur = 0;
        if (n_tokens > cells.size()) return false;
        uint32_t n_tested = 0;
        while (true) {
            if (head_cur + 1 > cells.size()) {
                n_tested += cells.size() - head_cur;
                head_cur = 0;
                continue;
            }
            const uint32_t idx = head_cur;
            head_cur++;
            n_tested++;
            bool can_use = cells.is_empty(idx);
            if (!can_use && cells.seq_count(idx) == 1) {
                const int32_t pos_cell = cells.pos[idx];
                const int32_t seq_id_cell = cells.seq_get(idx);
                if (c->is_masked_swa(pos_cell, cells.seq_pos_max(seq_id_cell) + 1)) can_use = true;
            }
            if (can_use) res.idxs[s].push_back(idx);
            if (res.idxs[s].size() == n_tokens) break;
            if (n_tested >= cells.size()) return false;
        }
        if (res.idxs[s].size() < n_tokens) return false;
    }
    return true;
}

}  // namespace

bool kvb26_cache::seq_rm(int32_t seq_id, int32_t p0, int32_t p1) {
    if (p0 < 0) p0 = 0;
    if (p1 < 0) p1 = std::numeric_limits<int32_t>::max();
    for (uint32_t s = 0; s < n_stream(); ++s) {
        if (seq_id >= 0 && seq_to_stream[seq_id] != s) continue;
        cells26_t &cl = cells[s];
        uint32_t &head = heads[s];
        uint32_t new_head = cl.size();
        for (uint32_t i = 0; i < cl.size(); ++i) {
            if (!cl.pos_in(i, p0, p1)) continue;
            if (seq_id < 0) {
                cl.rm(i);
                if (new_head == cl.size()) new_head = i;
            } else if (cl.seq_has(i, seq_id) && cl.seq_rm(i, seq_id)) {
                if (new_head == cl.size()) new_head = i;
            }
        }
        if (new_head != cl.size() && new_head < head) head = new_head;
    }
    return true;
}

extern "C" {

kvb26_cache *kvb26_new(uint32_t size, uint32_t n_stream, uint32_t n_seq_max, uint32_t n_pad, uint32_t n_swa,
                       int32_t swa_type) {
    if (n_stream == 0 || n_seq_max == 0 || n_seq_max > KVB26_MAX_SEQ || (n_stream != 1 && n_stream != n_seq_max))
        return nullptr;
    kvb26_cache *c = new kvb26_cache();
    c->cells.resize(n_stream);
    for (auto &cl : c->cells) cl.resize(size);
    c->heads.assign(n_stream, 0);
    c->seq_to_stream.resize(n_seq_max);
    for (uint32_t s = 0; s < n_seq_max; ++s) c->seq_to_stream[s] = n_stream == 1 ? 0 : s;
    c->n_pad = n_pad;
    c->n_swa = n_swa;
    c->swa_type = swa_type;
    return c;
}

void kvb26_free(kvb26_cache *c) { delete c; }
uint32_t kvb26_head(const kvb26_cache *c, uint32_t stream) { return c->heads[stream]; }
uint32_t kvb26_used(const kvb26_cache *c, uint32_t stream) { return c->cells[stream].get_used(); }

void kvb26_cells(const kvb26_cache *c, uint32_t stream, int32_t *pos, uint64_t *seq) {
    const cells26_t &cl = c->cells[stream];
    for (uint32_t i = 0; i < cl.size(); ++i) {
        pos[i] = cl.pos[i];
        for (uint32_t w = 0; w < 4; ++w) {
            uint64_t x = 0;
            for (uint32_t b = 0; b < 64; ++b)
                if (cl.seq[i].test(64 * w + b)) x |= (uint64_t)1 << b;
            seq[4 * i + w] = x;
        }
    }
}

int kvb26_find_slot(kvb26_cache *c, uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                    const int32_t *seq_ids) {
    std::vector<int32_t> unq;
    uint32_t n_tps = 0;
    c->have_last = false;
    if (!groups_of(c, n_tokens, seq_off, seq_ids, unq, n_tps)) return -1;
    slot26_t sinfo;
    if (!find_slot26(c, unq, n_tps, sinfo)) return 0;
    // apply_ubatch
    int32_t seq_pos_max_rm[KVB26_MAX_SEQ];
    for (int s = 0; s < KVB26_MAX_SEQ; ++s) seq_pos_max_rm[s] = -1;
    for (uint32_t s = 0; s < sinfo.strm.size(); ++s) {
        for (uint32_t ii = 0; ii < n_tps; ++ii) {
            const uint32_t i = s * n_tps + ii;
            cells26_t &cells = c->cells[sinfo.strm[s]];
            const uint32_t idx = sinfo.idxs[s][ii];
            if (!cells.is_empty(idx)) {
                const int32_t sq = cells.seq_get(idx);
                seq_pos_max_rm[sq] = std::max(seq_pos_max_rm[sq], cells.pos[idx]);
                cells.rm(idx);
            }
            cells.pos_set(idx, pos[i]);
            for (uint32_t k = seq_off[i]; k < seq_off[i + 1]; ++k)
                if (!cells.seq_has(idx, seq_ids[k])) cells.seq_add(idx, seq_ids[k]);
        }
    }
    // keep every sequence's positions contiguous: purge what lies below an overwritten one
    for (int s = 0; s < KVB26_MAX_SEQ; ++s) {
        if (seq_pos_max_rm[s] == -1) continue;
        cells26_t &cells = c->cells[c->seq_to_stream[s]];
        if (cells.seq_pos_min(s) <= seq_pos_max_rm[s]) c->seq_rm(s, cells.seq_pos_min(s), seq_pos_max_rm[s] + 1);
    }
    for (uint32_t s = 0; s < sinfo.strm.size(); ++s) c->heads[sinfo.strm[s]] = sinfo.idxs[s].back() + 1;
    c->last = std::move(sinfo);
    c->have_last = true;
    return 1;
}

uint32_t kvb26_slot(const kvb26_cache *c, int32_t *streams, int32_t *cells) {
    if (!c->have_last) return 0;
    uint32_t t = 0;
    for (uint32_t g = 0; g < c->last.strm.size(); ++g)
        for (uint32_t idx : c->last.idxs[g]) {
            if (streams) streams[t] = (int32_t)c->last.strm[g];
            if (cells) cells[t] = (int32_t)idx;
            ++t;
        }
    return t;
}

int kvb26_seq_rm(kvb26_cache *c, int32_t s, int32_t p0, int32_t p1) {
    if (s >= (int32_t)c->seq_to_stream.size() || s < -1) return 0;
    return c->seq_rm(s, p0, p1) ? 1 : 0;
}

int32_t kvb26_seq_pos_min(const kvb26_cache *c, int32_t s) { return c->cells[c->seq_to_stream[s]].seq_pos_min(s); }
int32_t kvb26_seq_pos_max(const kvb26_cache *c, int32_t s) { return c->cells[c->seq_to_stream[s]].seq_pos_max(s); }

int kvb26_mask_shape(const kvb26_cache *c, uint32_t n_tokens, const uint32_t *seq_off, const int32_t *seq_ids,
                     uint32_t *n_blocks, uint32_t *rows, uint32_t *n_kv) {
    std::vector<int32_t> unq;
    uint32_t n_tps = 0;
    if (!groups_of(c, n_tokens, seq_off, seq_ids, unq, n_tps)) return -1;
    // get_n_kv: the streams of the ubatch, n_kv padded to at least 256 cells
    const uint32_t n_pad_cur = std::max(c->n_pad, 256u);
    uint32_t result = 0;
    for (int32_t s : unq) {
        const cells26_t &cl = c->cells[c->seq_to_stream[s]];
        const uint32_t padded = (cl.used_max_p1() + n_pad_cur - 1) / n_pad_cur * n_pad_cur;
        result = std::max(std::min(cl.size(), std::max(n_pad_cur, padded)), result);
    }
    *n_blocks = (uint32_t)unq.size();
    *rows = n_tps;
    *n_kv = result;
    return 0;
}

int kvb26_kq_mask(const kvb26_cache *c, uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                  const int32_t *seq_ids, int causal, float *data) {
    uint32_t n_stream, n_tps, n_kv32;
    if (kvb26_mask_shape(c, n_tokens, seq_off, seq_ids, &n_stream, &n_tps, &n_kv32) != 0) return -1;
    const int64_t n_kv = n_kv32;
    const float mask_keep = 0.0f, mask_drop = -INFINITY;
    const bool swa = c->swa_type != 0;
    // the smallest position of each sequence in the ubatch
    int32_t seq_pos_min[KVB26_MAX_SEQ];
    std::fill(seq_pos_min, seq_pos_min + KVB26_MAX_SEQ, INT32_MAX);
    for (uint32_t i = 0; i < n_tokens; ++i) {
        const int32_t s = seq_ids[seq_off[i]];
        seq_pos_min[s] = std::min(seq_pos_min[s], pos[i]);
    }
    for (uint32_t s = 0; s < n_stream; ++s) {
        // a sequence's later rows start from its first row: only the cells near the ubatch's
        // positions can differ between them
        std::unordered_map<int32_t, uint32_t> seq_srct;
        std::unordered_map<int32_t, std::vector<uint32_t>> seq_idxs;
        for (uint32_t ii = 0; ii < n_tps; ++ii) {
            const uint32_t i = s * n_tps + ii;
            const int32_t seq_id = seq_ids[seq_off[i]];
            const cells26_t &cells = c->cells[c->seq_to_stream[seq_id]];
            const int32_t p1 = pos[i];
            const uint64_t idst = (uint64_t)n_kv * i;
            bool prev = false;
            auto &idxs = seq_idxs[seq_id];
            if (seq_srct.find(seq_id) != seq_srct.end()) {
                const uint64_t idst_prev = (uint64_t)n_kv * seq_srct[seq_id];
                std::copy(data + idst_prev, data + idst_prev + n_kv, data + idst);
                prev = true;
            } else {
                idxs.clear();
                idxs.reserve(n_tokens + c->n_swa + 32);
                seq_srct[seq_id] = i;
            }
            for (uint32_t jj = 0; jj < n_kv; ++jj) {
                uint32_t j = jj;
                if (prev) {
                    if (jj >= idxs.size()) break;
                    j = idxs[jj];
                }
                bool drop = cells.is_empty(j) || !cells.seq_has(j, seq_id);
                if (!drop) {
                    const int32_t p0 = cells.pos[j];
                    if (!prev && p0 + (int32_t)(c->n_swa + 32) >= seq_pos_min[seq_id]) idxs.push_back(j);
                    drop = (causal && p0 > p1) || (swa && c->is_masked_swa(p0, p1));
                }
                data[idst + j] = drop ? mask_drop : mask_keep;
            }
        }
    }
    return 0;
}

}  // extern "C"
