"""PDFs built byte by byte for tests: a small file that is costly to read."""

from __future__ import annotations

import zlib


def shared_stream_pdf(pages: int, objects: int = 8000) -> bytes:
    """A PDF whose every page draws the one compressed content stream of `objects` text objects at distinct places
    (a few KB of zlib, hundreds of KB of operators): small on disk, each page as costly to read as the stream is
    long (PDFium ~0.6 s of CPU per page at 8,000 objects here, ~5 s at 40,000). What the sibling issue's 9.5 KB
    file was."""
    ops = b"".join(b"BT /F1 9 Tf %d %d Td (w%d) Tj ET\n" % (i % 600, (i // 600) % 800, i) for i in range(objects))
    packed = zlib.compress(ops, 9)
    bodies = [b"<< /Type /Catalog /Pages 2 0 R >>",
              b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % (5 + i) for i in range(pages))
              + b"] /Count %d >>" % pages,
              b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
              b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(packed) + packed + b"\nendstream"]
    bodies += [b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
               b"/Contents 4 0 R >>"] * pages
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(bodies, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(bodies) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(bodies) + 1, xref)
    return bytes(out)
