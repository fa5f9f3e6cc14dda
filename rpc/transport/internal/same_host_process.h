// What the same-host transport asks of the kernel about processes and
// sockets: /proc reads (the host's identity, a peer's run state), the
// cross-memory probe, and abstract Unix-socket addresses and peer
// credentials.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>

#include <cstdint>
#include <string>

namespace ddprpc::rpc::transport::same_host {

// A small /proc or /sys file's text, trailing blanks cut ("" if unreadable).
std::string read_small_file(const char* path);
// Where symbolic link `path` points ("" if it is none).
std::string link_target(const char* path);

// The state letter of process `pid` ('R', 'S', 'T', 'Z', ...), 0 if it is
// gone, or kStateUnknown when /proc cannot say (no descriptor left, no
// memory): the process then counts as running, since a failing read says
// nothing of the peer.
inline constexpr char kStateUnknown = '?';
char process_state(pid_t pid);

// What each process shows its peers to test cross-memory reads: its
// address goes in the handshake, and a peer that can read these bytes
// there can read this process's tensors.
extern const char kProbe[16];
// Whether this process can read `pid`'s kProbe at address `probe`.
bool can_read_remote(pid_t pid, uint64_t probe);

// The abstract-namespace address (sun_path[0] = 0) named `name`.
void set_abstract_address(const std::string& name, sockaddr_un* addr, socklen_t* len);
// The process at the other end of a connected Unix socket, and its user;
// 0 if the kernel does not say.
pid_t peer_pid_of(int fd, uid_t* uid);

}  // namespace ddprpc::rpc::transport::same_host
