"""A seccomp-BPF deny list for the code sandbox (x86_64), built without libseccomp.

The program (handed to ``bwrap --seccomp FD``):
1. kills the process if the syscall ABI is not x86_64 (no i386 ``int 0x80`` detour);
2. fails x32 syscalls (``nr >= 0x40000000``) with EPERM;
3. fails the syscalls below with EPERM (kernel attack surface a Python program never needs:
   tracing, mounts and namespaces, module and kexec loading, keyrings, BPF, perf,
   userfaultfd, io_uring, cross-process memory access, clock and reboot);
4. allows everything else.
"""

from __future__ import annotations

import errno
import platform
import struct

# x86_64 syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl).
DENIED_X86_64: dict[str, int] = {
    "ptrace": 101,
    "personality": 135,
    "pivot_root": 155,
    "chroot": 161,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "clock_settime": 227,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "fanotify_init": 300,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
}

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06
_RET_ALLOW = 0x7FFF0000
_RET_KILL_PROCESS = 0x80000000
_RET_EPERM = 0x00050000 | errno.EPERM


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def supported() -> bool:
    return platform.machine() == "x86_64"


def deny_list_program(denied: tuple[int, ...] = tuple(DENIED_X86_64.values())) -> bytes:
    """The BPF program as the raw ``struct sock_filter`` array bwrap reads."""
    prog = [
        _insn(_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        _insn(_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),
        _insn(_RET_K, 0, 0, _RET_KILL_PROCESS),
        _insn(_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        _insn(_JGE_K, 0, 1, _X32_BIT),
        _insn(_RET_K, 0, 0, _RET_EPERM),
    ]
    n = len(denied)
    for i, nr in enumerate(denied):
        # On a match jump over the remaining checks and the ALLOW to the EPERM return.
        prog.append(_insn(_JEQ_K, n - i, 0, nr))
    prog.append(_insn(_RET_K, 0, 0, _RET_ALLOW))
    prog.append(_insn(_RET_K, 0, 0, _RET_EPERM))
    return b"".join(prog)
