// Reads arrays of a store with zarrita.js (tests/readers/test_foreign_readers.py): node -> [dtype, shape, sha256 of
// the bytes], or "error: ..." where zarrita cannot read it.
import * as zarr from "zarrita";
import FileSystemStore from "@zarrita/storage/fs";
import { createHash } from "node:crypto";

const SCALARS = { float32: Float32Array, float64: Float64Array, int64: BigInt64Array, int32: Int32Array };
const [store, ...nodes] = process.argv.slice(2);
const root = zarr.root(new FileSystemStore(store));
const found = {};
for (const node of nodes) {
  try {
    const array = await zarr.open(root.resolve(node), { kind: "array" });
    const chunk = await zarr.get(array);
    // a 0-d array comes back as its value
    const data = chunk.data ?? new SCALARS[array.dtype]([chunk]);
    const bytes = Buffer.from(data.buffer, data.byteOffset, data.byteLength);
    found[node] = [array.dtype, chunk.shape ?? [], createHash("sha256").update(bytes).digest("hex")];
  } catch (error) {
    found[node] = `error: ${error.message}`;
  }
}
console.log(JSON.stringify(found));
