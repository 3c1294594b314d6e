"""SCTP packets by hand, for kernels without SCTP sockets (CONFIG_IP_SCTP unset) that still
track and filter SCTP (nf_conntrack_proto_sctp, nft's ``sctp`` and ``th`` matches): an INIT
chunk (the first packet of an association) sent from a raw socket of protocol 132, and the
packets a raw socket receives read back.

Formats: RFC 9260 (SCTP), section 3 (common header: source port, destination port,
verification tag, checksum; chunks of type, flags, length), 3.3.2 (INIT: initiate tag,
advertised receiver window credit, outbound and inbound streams, initial TSN); the checksum is
CRC32c (appendix A), whose result goes into the header least significant byte first (the
order Linux's ``sctp_compute_cksum`` compares with, a ``__le32``). conntrack checks it on the
receiving node and calls a packet with a wrong one invalid (which our table drops).

A raw IPv4 socket receives the IP header before the SCTP packet, a raw IPv6 socket the SCTP
packet only (ip(7), ipv6(7)); the ICMP and ICMPv6 errors an SCTP packet draws carry the start
of the packet that drew them (its IP header, then at least the 8 bytes of ports and tag).
"""

from __future__ import annotations

import secrets
import socket
import struct
from dataclasses import dataclass

PROTOCOL = 132  # IPPROTO_SCTP
INIT = 1  # chunk type
ABORT = 6
ICMP_PORT_UNREACHABLE = {socket.AF_INET: (3, 3), socket.AF_INET6: (1, 4)}  # (type, code) of each family


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli's polynomial, reflected
        table.append(crc)
    return tuple(table)


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC32c (iSCSI, SCTP) of ``data``: ``crc32c(b"123456789") == 0xE3069283``."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def init_packet(source_port: int, destination_port: int, initiate_tag: int) -> bytes:
    """An SCTP packet of one INIT chunk (verification tag 0, as an INIT's must be), with its
    checksum; ``initiate_tag`` (non-zero) names the association the INIT would open."""
    chunk = struct.pack("!BBHIIHHI", INIT, 0, 20, initiate_tag, 65535, 1, 1, initiate_tag)
    header = struct.pack("!HHII", source_port, destination_port, 0, 0)
    checksum = crc32c(header + chunk)
    return header[:8] + struct.pack("<I", checksum) + chunk


@dataclass(frozen=True)
class Sctp:
    """What a received SCTP packet says: its ports, verification tag, first chunk's type, and
    for an INIT its initiate tag (else 0)."""

    source_port: int
    destination_port: int
    tag: int
    chunk: int
    initiate_tag: int

    @staticmethod
    def parse(packet: bytes) -> "Sctp | None":
        """The SCTP packet ``packet`` (no IP header), or None when it is too short."""
        if len(packet) < 16:
            return None
        source, destination, tag = struct.unpack("!HHI", packet[:8])
        chunk = packet[12]
        initiate = struct.unpack("!I", packet[16:20])[0] if chunk == INIT and len(packet) >= 20 else 0
        return Sctp(source, destination, tag, chunk, initiate)


def sctp_of(family: int, received: bytes) -> Sctp | None:
    """The SCTP packet in what a raw socket of protocol 132 and ``family`` received."""
    return Sctp.parse(received[(received[0] & 0x0F) * 4:] if family == socket.AF_INET else received)


def icmp_error_of(family: int, received: bytes) -> tuple[int, int, int, int] | None:
    """For what a raw ICMP (ICMPv6) socket received: (type, code, source port, destination port
    of the SCTP packet it quotes), or None when it quotes no SCTP packet."""
    if family == socket.AF_INET:
        icmp = received[(received[0] & 0x0F) * 4:]
        quoted = icmp[8:]
        if len(quoted) < 20 or quoted[9] != PROTOCOL:
            return None
        sctp = quoted[(quoted[0] & 0x0F) * 4:]
    else:
        icmp, quoted = received, received[8:]
        if len(quoted) < 40 or quoted[6] != PROTOCOL:
            return None
        sctp = quoted[40:]
    if len(sctp) < 4:
        return None
    return icmp[0], icmp[1], *struct.unpack("!HH", sctp[:4])


def new_tag() -> int:
    """A random non-zero initiate tag."""
    return secrets.randbelow(2**32 - 1) + 1
