"""The corpus of PyTorch .pt files (dev/test/corpus/pt/): small state_dicts laid out as torch.save
writes them (protocol 2 pickles of an OrderedDict of torch._utils._rebuild_tensor_v2 calls on
persistent storages; the zip format and the legacy one), and hostile or damaged variants, each
refused by ptfile.h with one line. The pickles are assembled opcode by opcode, so the hostile ones
can say what torch never would. Python's standard library only.

    python3 scripts/make_pt_corpus.py      # deterministic: the same bytes every time
"""

import io
import os
import struct
import zipfile

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dev", "test", "corpus", "pt")


def uni(s):
    b = s.encode()
    return (b"\x8c" + bytes([len(b)]) + b) if len(b) < 256 else (b"X" + struct.pack("<I", len(b)) + b)


def int_(n):
    if 0 <= n < 256:
        return b"K" + bytes([n])
    return b"J" + struct.pack("<i", n) if -2**31 <= n < 2**31 else b"\x8a\x08" + struct.pack("<q", n)


def tup(*items):
    return b"(" + b"".join(items) + b"t"


def tensor(key, storage_type, numel, offset, shape, stride):
    """_rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict()), as torch pickles it."""
    pid = tup(uni("storage"), b"ctorch\n" + storage_type.encode() + b"\n", uni(key), uni("cpu"), int_(numel))
    return (b"ctorch._utils\n_rebuild_tensor_v2\n" + b"(" + pid + b"Q" + int_(offset) + tup(*map(int_, shape)) +
            tup(*map(int_, stride)) + b"\x89" + b"ccollections\nOrderedDict\n)R" + b"t" + b"R")


def state_dict(entries, metadata=True):
    """PROTO 2, OrderedDict() with SETITEMS of (name, tensor pickle) and torch's _metadata BUILD."""
    body = b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01(" + b"".join(uni(k) + v for k, v in entries) + b"u"
    if metadata:
        body += b"}" + uni("_metadata") + b"ccollections\nOrderedDict\n)R" + uni("") + b"}" + uni("version") + int_(1) + b"sssb"
    return body + b"."


def zip_file(pickle, storages, name="archive"):
    """torch.save's zip layout: ARCHIVE/data.pkl, ARCHIVE/data/KEY (stored), version, byteorder."""
    buffer = io.BytesIO()
    def entry(n):  # a fixed date, so that the files are the same every time
        return zipfile.ZipInfo(n, date_time=(1980, 1, 1, 0, 0, 0))
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as z:
        z.writestr(entry(f"{name}/data.pkl"), pickle)
        z.writestr(entry(f"{name}/byteorder"), "little")
        for key, data in storages.items():
            z.writestr(entry(f"{name}/data/{key}"), data)
        z.writestr(entry(f"{name}/version"), "3\n")
    return buffer.getvalue()


def local_header(name, data):
    n = name.encode()
    return struct.pack("<IHHHHHIIIHH", 0x04034b50, 20, 0, 0, 0, 0, 0, len(data), len(data), len(n), 0) + n


def raw_zip(entries, inner=None):
    """A stored zip of entries (name, data), a name twice where given twice, and a directory entry for
    inner = (name, data, at): a record that lies `at` bytes into the last entry's data."""
    out, directory = b"", []
    for name, data in entries:
        directory.append((name, data, len(out)))
        out += local_header(name, data) + data
    if inner:
        name, data, at = inner
        directory.append((name, data, directory[-1][2] + len(local_header(directory[-1][0], b"")) + at))
    start = len(out)
    for name, data, offset in directory:
        out += central_record(name, data, offset)
    return out + end_record(len(directory), len(out) - start, start)


def central_record(name, data, offset):
    n = name.encode()
    return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014b50, 20, 20, 0, 0, 0, 0, 0, len(data), len(data), len(n), 0, 0, 0, 0, 0,
                       offset) + n


def end_record(entries, dir_size, dir_at):
    return struct.pack("<IHHHHIIH", 0x06054b50, 0, 0, entries, entries, dir_size, dir_at, 0)


def legacy_file(pickle, storages):
    """torch.save(..., _use_new_zipfile_serialization=False): magic, 1001, system info, the object,
    the storage keys, then each storage as int64 element count and bytes."""
    magic = b"\x80\x02\x8a\x0a" + bytes([0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19]) + b"."
    proto = b"\x80\x02M\xe9\x03."
    info = (b"\x80\x02}(" + uni("protocol_version") + b"M\xe9\x03" + uni("little_endian") + b"\x88" + uni("type_sizes") +
            b"}(" + uni("short") + int_(2) + uni("int") + int_(4) + uni("long") + int_(4) + b"uu.")
    keys = b"\x80\x02]" + b"(" + b"".join(uni(k) for k in storages) + b"e."
    data = b"".join(struct.pack("<q", len(d) // size) + d for (d, size) in storages.values())
    return magic + proto + info + pickle + keys + data


F32 = struct.pack("<6f", 0.5, -1.0, 2.0, 0.25, 3.0, -0.125)
F16 = struct.pack("<4e", 1.0, -2.0, 0.5, 4.0)
GOOD = [("a.weight", tensor("0", "FloatStorage", 6, 0, (2, 3), (3, 1))),
        ("a.bias", tensor("1", "HalfStorage", 4, 1, (3,), (1,)))]


def main():
    os.makedirs(OUT, exist_ok=True)
    files = {}
    sd = state_dict(GOOD)
    files["good_zip.pt"] = zip_file(sd, {"0": F32, "1": F16})
    files["good_legacy.pt"] = legacy_file(sd, {"0": (F32, 4), "1": (F16, 2)})
    files["bad_os_system.pt"] = zip_file(b"\x80\x02cos\nsystem\n" + uni("echo owned") + b"\x85R.", {})
    files["bad_builtins_eval_legacy.pt"] = b"\x80\x02cbuiltins\neval\n" + uni("1") + b"\x85R."
    files["bad_nested_lists.pt"] = zip_file(b"\x80\x02" + b"]" * 40 + b"a" * 39 + b".", {})
    files["bad_list_in_itself.pt"] = zip_file(b"\x80\x02]q\x00" + b"h\x00a" * 40 + b".", {})
    files["bad_unknown_opcode.pt"] = zip_file(b"\x80\x02}Z.", {})
    files["bad_memo_slot_huge.pt"] = zip_file(b"\x80\x02}r\xff\xff\xff\xff.", {})
    files["bad_memo_slot_past_length.pt"] = zip_file(b"\x80\x02}r\xff\xff\x3f\x00.", {})  # 2^22 - 1: in bounds, but no pickler's
    files["bad_not_a_tensor.pt"] = zip_file(b"\x80\x02}" + uni("a.weight") + int_(3) + b"s.", {})
    files["bad_storage_out_of_range.pt"] = zip_file(
        state_dict([("a.weight", tensor("0", "FloatStorage", 6, 2, (2, 3), (3, 1)))]), {"0": F32})
    files["bad_storage_short.pt"] = zip_file(state_dict([("a.weight", tensor("0", "FloatStorage", 6, 0, (2, 3), (3, 1)))]),
                                             {"0": F32[:20]})
    files["bad_storage_missing.pt"] = zip_file(state_dict([("a.weight", tensor("7", "FloatStorage", 6, 0, (2, 3), (3, 1)))]),
                                               {"0": F32})
    files["bad_not_contiguous.pt"] = zip_file(state_dict([("a.weight", tensor("0", "FloatStorage", 6, 0, (2, 3), (1, 2)))]),
                                              {"0": F32})
    files["bad_truncated.pt"] = files["good_zip.pt"][:-40]
    files["bad_legacy_truncated.pt"] = files["good_legacy.pt"][:-3]
    files["bad_legacy_wrong_magic.pt"] = files["good_legacy.pt"].replace(b"\x6c\xfc\x9c", b"\x6c\xfc\x9d", 1)
    files["bad_no_stop.pt"] = zip_file(sd[:-1], {"0": F32, "1": F16})
    files["bad_empty.pt"] = zip_file(b"\x80\x02}.", {})
    # two entries sharing bytes: storage 1's whole record (local header and data) inside storage 0's data
    files["bad_zip_overlap.pt"] = raw_zip([("archive/data.pkl", sd), ("archive/data/0", F32 + local_header("archive/data/1", F16) + F16)],
                                          inner=("archive/data/1", F16, len(F32)))
    # a name twice, another entry between the two: Python's zipfile reads the last, so the file has no one meaning
    files["bad_zip_duplicate_pkl.pt"] = raw_zip([("archive/data.pkl", sd), ("archive/data/0", F32), ("archive/data/1", F16),
                                                 ("archive/data.pkl", state_dict(GOOD[:1]))])
    files["bad_zip_duplicate_storage.pt"] = raw_zip([("archive/data.pkl", sd), ("archive/data/0", F32), ("archive/data/1", F16),
                                                     ("archive/data/0", F32[::-1])])
    # the directory's entry points at a local header in the file's last 30 bytes: its name would lie past the end
    version = local_header("archive/version", b"3\n") + b"3\n"
    tail_at = len(version) + 2 * 46 + len("archive/version") + len("archive/data.pkl") + 22  # after the directory and end record
    directory = central_record("archive/version", b"3\n", 0) + central_record("archive/data.pkl", sd, tail_at)
    files["bad_zip_local_header_at_end.pt"] = (version + directory + end_record(2, len(directory), len(version)) +
                                               local_header("archive/data.pkl", sd)[:30])
    # sizes of 2^24 and 2^40, each in range, whose product (2^64) wraps to 0 elements in int64
    files["bad_numel_overflow.pt"] = zip_file(
        state_dict([("a.weight", tensor("0", "FloatStorage", 6, 0, (2**24, 2**40), (2**40, 1)))]), {"0": F32})
    good = files["good_zip.pt"]
    end = good.rfind(b"PK\x05\x06")
    dir_at = struct.unpack_from("<I", good, end + 16)[0]
    compressed = bytearray(files["good_zip.pt"])
    struct.pack_into("<H", compressed, dir_at + 10, 8)
    files["bad_zip_compressed.pt"] = bytes(compressed)
    for name, data in sorted(files.items()):
        assert len(data) < 4096, name
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    print(f"wrote {len(files)} files to {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
