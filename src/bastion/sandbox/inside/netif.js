// bastion: keeps node's os.networkInterfaces() working in a sandbox. Preloaded into every node process
// through NODE_OPTIONS=--require=/opt/bastion/netif.js (the sandbox's default environment).
//
// The sandbox's seccomp filter refuses netlink sockets (EAFNOSUPPORT: their receive queues hold host
// memory no cgroup counts; see bastion/sandbox/seccomp.py), so libuv's getifaddrs() fails and node
// throws ERR_SYSTEM_ERROR ("uv_interface_addresses returned Unknown system error 97"). Dev servers call
// it to print their network URL (Next.js, webpack-dev-server, vite --host). On that error alone this
// answers with the loopback interface, the only one a sandbox's network namespace has, as node shows it.
// A compatibility shim, not a security layer: a process started without it gets node's error, nothing more.
"use strict";

const fs = require("fs");
const os = require("os");

const original = os.networkInterfaces;
const EAFNOSUPPORT = os.constants.errno.EAFNOSUPPORT;
const MAC = "00:00:00:00:00:00";
const IPV6_LOOPBACK = "00000000000000000000000000000001";

function refusedNetlink(error) {
  const info = error && error.code === "ERR_SYSTEM_ERROR" ? error.info : undefined;
  return Boolean(info && info.syscall === "uv_interface_addresses" && Math.abs(info.errno) === EAFNOSUPPORT);
}

// ::1 is there unless IPv6 is off; /proc/net/if_inet6 lists the namespace's IPv6 addresses without netlink.
function hasIpv6Loopback() {
  try {
    return fs
      .readFileSync("/proc/net/if_inet6", "utf8")
      .split("\n")
      .some((line) => line.startsWith(IPV6_LOOPBACK + " ") && line.trim().endsWith(" lo"));
  } catch (error) {
    return false;
  }
}

function loopback() {
  const lo = [
    { address: "127.0.0.1", netmask: "255.0.0.0", family: "IPv4", mac: MAC, internal: true, cidr: "127.0.0.1/8" },
  ];
  if (hasIpv6Loopback()) {
    const netmask = "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff";
    lo.push({ address: "::1", netmask, family: "IPv6", mac: MAC, internal: true, cidr: "::1/128", scopeid: 0 });
  }
  return { lo };
}

function networkInterfaces(...args) {
  try {
    return original.apply(this, args);
  } catch (error) {
    if (refusedNetlink(error)) {
      return loopback();
    }
    throw error;
  }
}

os.networkInterfaces = networkInterfaces;
// `import { networkInterfaces } from "node:os"` reads a copy of the exports made at first import (node 12.12+).
const { syncBuiltinESMExports } = require("module");
if (syncBuiltinESMExports) {
  syncBuiltinESMExports();
}
