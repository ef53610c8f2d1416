#!/usr/bin/env python3
"""Small helpers for prepare.sh (stdlib only).

  guestkit.py extract-vmlinux BZIMAGE OUT   ELF vmlinux out of an x86 bzImage
  guestkit.py has-pvh-note VMLINUX          exit 0 iff ELF has the Xen PVH entry note
  guestkit.py decompress IN OUT             .ko.xz/.ko.gz/.ko.zst -> plain file
  guestkit.py elf-kind FILE                 prints static|dynamic|not-elf|not-x86_64

extract-vmlinux follows the kernel's scripts/extract-vmlinux idea, but first
uses the boot-protocol header (payload_offset/payload_length) and only falls
back to scanning for compression magics.
"""
import bz2
import gzip
import lzma
import shutil
import struct
import subprocess
import sys
import zlib

MAGICS = [  # (name, magic)
    ("xz", b"\xfd7zXZ\x00"),
    ("gzip", b"\x1f\x8b\x08"),
    ("zstd", b"\x28\xb5\x2f\xfd"),
    ("bzip2", b"BZh"),
    ("lzma", b"\x5d\x00\x00\x00"),
]


def die(msg):
    sys.stderr.write("guestkit: error: %s\n" % msg)
    sys.exit(1)


def decompress_stream(kind, data):
    """Decompress the first stream in data; trailing garbage is ignored."""
    if kind == "xz":
        return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data)
    if kind == "lzma":
        return lzma.LZMADecompressor(format=lzma.FORMAT_ALONE).decompress(data)
    if kind == "gzip":
        return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)
    if kind == "bzip2":
        return bz2.BZ2Decompressor().decompress(data)
    if kind == "zstd":
        try:
            import zstandard  # type: ignore
            return zstandard.ZstdDecompressor().decompressobj().decompress(data)
        except ImportError:
            pass
        if shutil.which("zstd") is None:
            raise RuntimeError("zstd payload but neither python zstandard nor zstd CLI available")
        return subprocess.run(["zstd", "-dc"], input=data, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL).stdout
    raise RuntimeError("unsupported compression " + kind)


def is_elf(blob):
    return blob[:4] == b"\x7fELF"


def extract_vmlinux(src, dst):
    data = open(src, "rb").read()
    candidates = []
    if len(data) > 0x250 and data[0x202:0x206] == b"HdrS":
        setup_sects = data[0x1F1] or 4
        off, length = struct.unpack_from("<II", data, 0x248)
        start = (setup_sects + 1) * 512 + off
        payload = data[start:start + length]
        for name, magic in MAGICS:
            if payload.startswith(magic):
                candidates.append((name, start))
                break
    for name, magic in MAGICS:  # fallback: scan like scripts/extract-vmlinux
        pos = data.find(magic)
        while pos != -1 and len(candidates) < 64:
            candidates.append((name, pos))
            pos = data.find(magic, pos + 1)
    for name, pos in candidates:
        try:
            out = decompress_stream(name, data[pos:])
        except Exception:  # noqa: BLE001 - wrong guess, try next
            continue
        if is_elf(out):
            with open(dst, "wb") as f:
                f.write(out)
            print("extracted %s payload at offset %#x -> %d bytes" % (name, pos, len(out)))
            return
    die("no decompressible ELF payload found in %s" % src)


def has_pvh_note(path):
    data = open(path, "rb").read()
    if not is_elf(data) or data[4] != 2:
        return False
    e_phoff, = struct.unpack_from("<Q", data, 0x20)
    e_phentsize, e_phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(e_phnum):
        p_type, _fl, p_off, _va, _pa, p_filesz = struct.unpack_from("<IIQQQQ", data, e_phoff + i * e_phentsize)
        if p_type != 4:  # PT_NOTE
            continue
        pos, end = p_off, p_off + p_filesz
        while pos + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", data, pos)
            name = data[pos + 12:pos + 12 + namesz].rstrip(b"\x00")
            if name == b"Xen" and ntype == 18:  # XEN_ELFNOTE_PHYS32_ENTRY
                return True
            pos += 12 + ((namesz + 3) & ~3) + ((descsz + 3) & ~3)
    return False


def elf_kind(path):
    with open(path, "rb") as f:
        data = f.read(1 << 16)
    if not is_elf(data) or len(data) < 64:
        return "not-elf"
    if data[4] != 2 or struct.unpack_from("<H", data, 0x12)[0] != 62:  # ELFCLASS64, EM_X86_64
        return "not-x86_64"
    e_phoff, = struct.unpack_from("<Q", data, 0x20)
    e_phentsize, e_phnum = struct.unpack_from("<HH", data, 0x36)
    with open(path, "rb") as f:
        f.seek(e_phoff)
        ph = f.read(e_phentsize * e_phnum)
    for i in range(e_phnum):
        if struct.unpack_from("<I", ph, i * e_phentsize)[0] == 3:  # PT_INTERP
            return "dynamic"
    return "static"


def decompress_file(src, dst):
    data = open(src, "rb").read()
    for name, magic in MAGICS:
        if data.startswith(magic):
            if name == "gzip":
                out = gzip.decompress(data)
            else:
                out = decompress_stream(name, data)
            break
    else:
        out = data
    if not is_elf(out):
        die("%s did not decompress to an ELF object" % src)
    with open(dst, "wb") as f:
        f.write(out)


def main(argv):
    if len(argv) == 3 and argv[0] == "extract-vmlinux":
        extract_vmlinux(argv[1], argv[2])
    elif len(argv) == 2 and argv[0] == "has-pvh-note":
        sys.exit(0 if has_pvh_note(argv[1]) else 1)
    elif len(argv) == 2 and argv[0] == "elf-kind":
        print(elf_kind(argv[1]))
    elif len(argv) == 3 and argv[0] == "decompress":
        decompress_file(argv[1], argv[2])
    else:
        die("usage: see module docstring")


if __name__ == "__main__":
    main(sys.argv[1:])
