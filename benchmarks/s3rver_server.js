// s3rver (a Node S3 server that keeps objects in a directory) behind the same latency-and-counts front as
// s3_latency.py's LatencyAndCounts: a sleep of the set latency before each request, counts by method, and the
// /__bench__/{latency?ms=N,counts,reset} control paths, reporting this process's CPU time as server_cpu_s.
//
//   node benchmarks/s3rver_server.js DIRECTORY BUCKET   (prints "listening PORT" once it serves on 127.0.0.1)
//
// s3_latency.py --server s3rver starts it; NODE_PATH must name a node_modules holding s3rver (npm install s3rver).
"use strict";

const fs = require("fs");
const http = require("http");
const path = require("path");
const S3rver = require("s3rver");

async function main() {
  const [directory, bucket] = process.argv.slice(2);
  if (!directory || !bucket) {
    throw new Error("usage: node s3rver_server.js DIRECTORY BUCKET");
  }
  const s3 = new S3rver({ silent: true, directory, configureBuckets: [{ name: bucket }] });
  await s3.configureBuckets();
  const handle = s3.callback();
  let latencyMs = 0;
  let counts = {};
  let cpuAtReset = process.cpuUsage();

  const server = http.createServer((request, response) => {
    if (request.url.startsWith("/__bench__/")) {
      const [route, query] = request.url.split("?");
      if (route === "/__bench__/latency") {
        latencyMs = Number((query || "").replace("ms=", ""));
      }
      const cpu = process.cpuUsage(cpuAtReset);
      const body = JSON.stringify({ methods: counts, server_cpu_s: (cpu.user + cpu.system) / 1e6 });
      if (route === "/__bench__/reset") {
        counts = {};
        cpuAtReset = process.cpuUsage();
      }
      response.writeHead(200, { "Content-Type": "application/json", "Content-Length": Buffer.byteLength(body) });
      response.end(body);
      return;
    }
    counts[request.method] = (counts[request.method] || 0) + 1;
    fixSuffixRange(request, directory);
    if (latencyMs > 0) {
      // Nothing reads the request body before the handler runs (the stream stays paused, buffering): the sleep
      // delays the whole request, as moto's does.
      setTimeout(() => handle(request, response), latencyMs);
    } else {
      handle(request, response);
    }
  });
  server.keepAliveTimeout = 60000;
  server.listen(0, "127.0.0.1", () => {
    process.stdout.write(`listening ${server.address().port}\n`);
  });
}

// s3rver 3.7.1 serves "Range: bytes=-N" (the last N bytes) as bytes 0-N, which dcp_zarr's checksums refuse as a
// corrupt shard index: rewrite it as the explicit range of the object's last N bytes (its file in s3rver's store).
function fixSuffixRange(request, directory) {
  const suffix = /^bytes=-(\d+)$/.exec(request.headers.range || "");
  if (request.method !== "GET" || !suffix) {
    return;
  }
  const objectPath = decodeURIComponent(new URL(request.url, "http://localhost").pathname);
  let size;
  try {
    size = fs.statSync(path.join(directory, objectPath) + "._S3rver_object").size;
  } catch {
    return; // a missing object: s3rver answers NoSuchKey itself
  }
  const first = Math.max(0, size - Number(suffix[1]));
  request.headers.range = `bytes=${first}-${size - 1}`;
}

main().catch((error) => {
  process.stderr.write(`${error.stack || error}\n`);
  process.exit(1);
});
