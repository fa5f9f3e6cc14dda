// How many bytes a reader of a TCP socket lets the kernel gather before it
// is woken (SO_RCVLOWAT), for the project's own bulk streams: the bulk
// path's pulls and pushes, the TCP ring, and the benchmarks' raw TCP bound.
//
// By default the kernel wakes a sleeping reader for every segment that
// arrives: on veth and loopback one per 64 KiB, so a 1 MiB read wakes its
// thread about 16 times, each wake-up a trip through the scheduler that
// the sender's CPU pays for too. With the mark at half a megabyte, that
// read wakes twice.
//
// Contract for the reader, or it can sleep forever:
//   - Call expect_bytes() with the bytes still to come before each wait,
//     so the mark never exceeds what the peer is going to send.
//   - Wait with poll() and read with MSG_DONTWAIT, never with a recv()
//     that blocks: a blocking recv() that has already copied part of its
//     bytes sleeps on, and the kernel wakes it only when a full mark of
//     *new* bytes is waiting, which the end of the stream may never bring.
//   - Put the mark back (reset_low_water) before the socket is read in
//     any other way.
// The reads still end when the kernel runs short of receive window or
// memory below the mark: it then wakes the reader early, which Linux does
// since fixes for such hangs in its 5.x series. Measured on 6.18.
#pragma once

#include <cstddef>

namespace ddprpc::rpc::internal {

// The mark for reads of at least this much. Between network namespaces on
// 2 CPUs, 512 KiB made 4-64 MiB allreduces 12-20% faster and 64 MiB round
// trips over three connections 7-30% faster than no mark; 256 KiB gained
// less at 64 MiB.
constexpr size_t kReceiveLowWaterBytes = size_t{512} << 10;

// Reads shorter than this, a segment's worth, wake their reader once
// anyway: a mark would only cost two more system calls.
constexpr size_t kLowWaterMinReadBytes = size_t{64} << 10;

// Sets fd's receive low-water mark to min(left, kReceiveLowWaterBytes)
// (at least 1) unless *current already holds that value; *current is the
// caller's record of the socket's mark (1 for a fresh socket).
void expect_bytes(int fd, size_t left, int* current);

// Puts the mark back to the kernel's default of 1 byte.
inline void reset_low_water(int fd, int* current) { expect_bytes(fd, 1, current); }

}  // namespace ddprpc::rpc::internal
