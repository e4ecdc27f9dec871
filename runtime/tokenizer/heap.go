package tokenizer

// mergeItem is one candidate merge of the symbol at pos with its right
// neighbour. Candidates are taken smallest key first and, on equal keys,
// leftmost first; both BPE loops store enough to detect stale candidates.
type mergeItem struct {
	key   float64 // -score (SentencePiece) or merge rank (HF BPE)
	pos   int32   // left symbol index
	right int32   // right symbol index at push time
	size  int32   // SentencePiece: byte length of the merged piece
	a, b  int32   // HF BPE: ids of the two symbols at push time
	newID int32   // HF BPE: id of the merged token
}

func (x *mergeItem) less(y *mergeItem) bool {
	if x.key != y.key {
		return x.key < y.key
	}
	return x.pos < y.pos
}

// mergeHeap is a binary min-heap of merge candidates (no interface calls, so
// the merge loops stay cheap on long inputs).
type mergeHeap struct{ items []mergeItem }

func (h *mergeHeap) len() int { return len(h.items) }

func (h *mergeHeap) reset() { h.items = h.items[:0] }

func (h *mergeHeap) push(it mergeItem) {
	h.items = append(h.items, it)
	i := len(h.items) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !h.items[i].less(&h.items[p]) {
			break
		}
		h.items[i], h.items[p] = h.items[p], h.items[i]
		i = p
	}
}

func (h *mergeHeap) pop() mergeItem {
	top := h.items[0]
	n := len(h.items) - 1
	h.items[0] = h.items[n]
	h.items = h.items[:n]
	i := 0
	for {
		l := 2*i + 1
		if l >= n {
			break
		}
		m := l
		if r := l + 1; r < n && h.items[r].less(&h.items[l]) {
			m = r
		}
		if !h.items[m].less(&h.items[i]) {
			break
		}
		h.items[i], h.items[m] = h.items[m], h.items[i]
		i = m
	}
	return top
}
