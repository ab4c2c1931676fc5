import gzip

import numpy as np

from sftmix.output.olmo_format import (
    BOUNDS_PART,
    MASK_PART,
    TOKENS_PART,
    PartLayout,
    PartSet,
    part_layout,
    part_tokens,
    write_boundaries,
)


def test_part_size_is_one_gib_of_ids():
    assert part_tokens(np.dtype(np.uint32)) == 1024**3 // 4
    assert part_tokens(np.dtype(np.uint16)) == 1024**3 // 2


def test_documents_straddle_parts_and_boundaries_are_clipped(tmp_path):
    lengths = np.array([4, 7, 3, 6])
    ends = np.cumsum(lengths)
    starts = ends - lengths
    per_part = 8
    layout = PartLayout.by_count(int(ends[-1]), per_part)
    parts = PartSet(tmp_path, layout, np.dtype(np.uint16))
    for i, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
        parts.write(s, np.full(n, i + 1, dtype=np.uint16), np.full(n, i % 2, dtype=np.uint8))
    parts.close()
    write_boundaries(tmp_path, starts, ends, layout)
    tokens = [np.fromfile(tmp_path / TOKENS_PART.format(k), dtype=np.uint16) for k in range(3)]
    masks = [np.fromfile(tmp_path / MASK_PART.format(k), dtype=np.bool_) for k in range(3)]
    assert [t.size for t in tokens] == [8, 8, 4]
    assert np.concatenate(tokens).tolist() == [1] * 4 + [2] * 7 + [3] * 3 + [4] * 6
    assert np.concatenate(masks).astype(int).tolist() == [0] * 4 + [1] * 7 + [0] * 3 + [1] * 6
    lines = []
    for k in range(3):
        with gzip.open(tmp_path / BOUNDS_PART.format(k), "rt") as fh:
            lines.append(fh.read().split())
    assert lines == [["0,4", "4,8"], ["0,3", "3,6", "6,8"], ["0,4"]]


def test_whole_document_parts_end_where_a_document_ends(tmp_path):
    """``whole_documents``: each part ends at the last document end within the part size; a document longer
    than a part has a part of its own; every document is one line of one part, and the tokens are the
    same as the reference layout's, in the same order."""
    lengths = np.array([4, 7, 3, 12, 2, 1])
    ends = np.cumsum(lengths)
    starts = ends - lengths
    dtype = np.dtype(np.uint16)
    layout = part_layout("whole_documents", 10 * dtype.itemsize, dtype, ends)
    assert layout.firsts == (0, 4, 14, 26) and layout.total == 29  # [4] [7 3] [12] [2 1]
    assert part_layout("reference", 16, dtype, ends) == PartLayout.by_count(29, 8)
    assert list(layout.spans(3, 13)) == [(0, 3, 0, 1), (1, 0, 1, 10), (2, 0, 11, 2)]
    parts = PartSet(tmp_path, layout, dtype)
    for i, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
        parts.write(s, np.full(n, i + 1, dtype=dtype), np.ones(n, dtype=np.uint8))
    parts.close()
    write_boundaries(tmp_path, starts, ends, layout)
    tokens = [np.fromfile(tmp_path / TOKENS_PART.format(k), dtype=dtype) for k in range(4)]
    assert [t.size for t in tokens] == [4, 10, 12, 3]
    assert np.concatenate(tokens).tolist() == np.repeat(np.arange(1, 7), lengths).tolist()
    lines = [gzip.decompress((tmp_path / BOUNDS_PART.format(k)).read_bytes()).split() for k in range(4)]
    assert lines == [[b"0,4"], [b"0,7", b"7,10"], [b"0,12"], [b"0,2", b"2,3"]]
    assert part_layout("whole_documents", 16, dtype, np.zeros(0, np.int64)).firsts == ()


def test_boundary_files_are_the_same_bytes_run_after_run(tmp_path):
    """Their gzip header holds no time and no name: the same boundaries give the same file."""
    lengths = np.arange(1, 250_001) % 97 + 1
    ends = np.cumsum(lengths)
    starts = ends - lengths
    written = []
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        write_boundaries(tmp_path / run, starts, ends, PartLayout.by_count(int(ends[-1]), int(ends[-1])))
        written.append((tmp_path / run / BOUNDS_PART.format(0)).read_bytes())
    assert written[0] == written[1]
    assert gzip.decompress(written[0]).decode() == "".join(
        f"{s},{e}\n" for s, e in zip(starts.tolist(), ends.tolist(), strict=True)
    )
