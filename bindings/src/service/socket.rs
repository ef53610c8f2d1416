//! The Unix socket's two jobs beyond connecting: handing the client its shared memory
//! (SCM_RIGHTS), and telling the server who the client is (SO_PEERCRED, SO_PEERGROUPS).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

/// The peer's credentials as the kernel recorded them when it connected: a client cannot
/// choose them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (SO_PEERGROUPS).
    pub groups: Vec<u32>,
}

pub fn peer(sock: &UnixStream) -> io::Result<Peer> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a valid socket and an out-buffer of the size given.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut libc::ucred as *mut libc::c_void,
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // Linux caps supplementary groups at 65536; 1024 covers any real user, and a peer with
    // more is refused rather than judged on a partial list.
    let mut groups = vec![0u32; 1024];
    let mut len = (groups.len() * 4) as libc::socklen_t;
    // SAFETY: a valid socket and an out-buffer of the size given.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERGROUPS,
            groups.as_mut_ptr() as *mut libc::c_void,
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    groups.truncate(len as usize / 4);
    Ok(Peer {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
        groups,
    })
}

/// One byte of data and room for `fd_bytes` of descriptors: what [`send_fds`] and
/// [`recv_fds`] hand the kernel.
struct Message<'a> {
    iov: libc::iovec,
    control: Vec<u8>,
    _byte: std::marker::PhantomData<&'a mut [u8; 1]>,
}

impl<'a> Message<'a> {
    fn new(byte: &'a mut [u8; 1], fd_bytes: u32) -> Message<'a> {
        // SAFETY: CMSG_SPACE is a pure computation.
        let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
        Message {
            iov: libc::iovec {
                iov_base: byte.as_mut_ptr() as *mut libc::c_void,
                iov_len: 1,
            },
            control: vec![0u8; space],
            _byte: std::marker::PhantomData,
        }
    }

    /// The header pointing at this message's buffers (valid while `self` is).
    fn header(&mut self) -> libc::msghdr {
        // SAFETY: msghdr is plain data; zero is a valid start.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut self.iov;
        msg.msg_iovlen = 1;
        msg.msg_control = self.control.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = self.control.len() as _;
        msg
    }
}

/// Sends `fds` (at most [`FDS_MAX`], perhaps none) with one byte of data.
pub fn send_fds(sock: &UnixStream, fds: &[std::os::fd::RawFd]) -> io::Result<()> {
    assert!(fds.len() <= FDS_MAX);
    let mut byte = [1u8];
    let bytes = std::mem::size_of_val(fds) as u32;
    let mut m = Message::new(&mut byte, bytes);
    let mut msg = m.header();
    if fds.is_empty() {
        msg.msg_control = std::ptr::null_mut();
        msg.msg_controllen = 0;
    }
    // SAFETY: the control buffer holds one cmsg with `fds` (CMSG_SPACE above).
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null() {
            // No descriptors: the byte alone.
            return send_msg(sock, &msg);
        }
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(bytes) as _;
        std::ptr::copy_nonoverlapping(
            fds.as_ptr() as *const u8,
            libc::CMSG_DATA(cmsg),
            bytes as usize,
        );
    }
    send_msg(sock, &msg)
}

fn send_msg(sock: &UnixStream, msg: &libc::msghdr) -> io::Result<()> {
    // SAFETY: a valid socket and a message whose buffers live across the call.
    let sent = unsafe { libc::sendmsg(sock.as_raw_fd(), msg, libc::MSG_NOSIGNAL) };
    if sent != 1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The most descriptors one handshake message carries: the ring's memory and the reactor's
/// doorbell (the server's), the buffer arena (the client's).
pub const FDS_MAX: usize = 2;

/// Receives the descriptors [`send_fds`] sent (blocking, as the socket is): none if its
/// byte came alone.
pub fn recv_fds(sock: &UnixStream) -> io::Result<Vec<OwnedFd>> {
    let mut byte = [0u8];
    let most = (FDS_MAX * std::mem::size_of::<libc::c_int>()) as u32;
    let mut m = Message::new(&mut byte, most);
    let mut msg = m.header();
    // SAFETY: a valid socket and buffers that live across the call.
    let got = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    if got == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the other end closed the connection during the handshake",
        ));
    }
    // SAFETY: the kernel filled `msg`; CMSG_FIRSTHDR checks the length it reported, and
    // the descriptors it carries are ours from here on.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null() {
            return Ok(Vec::new());
        }
        if (*cmsg).cmsg_level != libc::SOL_SOCKET || (*cmsg).cmsg_type != libc::SCM_RIGHTS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "a handshake message with something else than descriptors",
            ));
        }
        let header = libc::CMSG_LEN(0) as usize;
        let n =
            ((*cmsg).cmsg_len as usize).saturating_sub(header) / std::mem::size_of::<libc::c_int>();
        let data = libc::CMSG_DATA(cmsg) as *const libc::c_int;
        Ok((0..n.min(FDS_MAX))
            .map(|k| OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(k))))
            .collect())
    }
}

/// Whether the other end has closed (or the socket failed): a poll that does not wait.
pub fn hung_up(sock: &UnixStream) -> bool {
    let mut p = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
}
