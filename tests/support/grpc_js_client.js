// grpc-js (@grpc/grpc-js, the pure-JavaScript gRPC of Node.js: its own HTTP/2 through Node's
// nghttp2 binding) against the lean gRPC server's echo methods in tests/transport/test_h2_grpc.py.
// Bytes in, bytes out (no .proto): prints one JSON object of what each call gave.
//   node tests/support/grpc_js_client.js PORT      (NODE_PATH holds @grpc/grpc-js)
'use strict';
const crypto = require('crypto');
const grpc = require('@grpc/grpc-js');

const port = process.argv[2];
const same = (b) => b;
const options = { 'grpc.max_receive_message_length': 64 << 20, 'grpc.max_send_message_length': 64 << 20 };

function call(client, method, payload, callOptions = {}) {
  return new Promise((resolve) => {
    client.makeUnaryRequest(method, same, same, payload, new grpc.Metadata(), callOptions, (err, reply) => {
      if (err) {
        const trailers = err.metadata ? err.metadata.getMap() : {};
        resolve({ code: err.code, details: err.details, trailers });
      } else {
        resolve({ reply });
      }
    });
  });
}

async function main() {
  const out = {};
  const client = new grpc.Client(`127.0.0.1:${port}`, grpc.credentials.createInsecure(), options);
  const small = Buffer.from('from grpc-js');
  out.small = (await call(client, '/t.Test/Echo', small)).reply?.equals(small) ?? false;
  const big = crypto.randomBytes(5 << 20); // over every window: flow control both ways
  out.big = (await call(client, '/t.Test/Echo', big)).reply?.equals(big) ?? false;
  const many = await Promise.all(Array.from({ length: 200 }, (_, i) => call(client, '/t.Test/Echo', Buffer.from(`call ${i}`))));
  out.concurrent = many.filter((r, i) => r.reply && r.reply.toString() === `call ${i}`).length;
  const failed = await call(client, '/t.Test/Fail', Buffer.alloc(0));
  out.fail = { code: failed.code, details: failed.details, retryAfter: failed.trailers['retry-after'] };
  const late = await call(client, '/t.Test/Sleep', Buffer.from('30'), { deadline: new Date(Date.now() + 500) });
  out.deadline = late.code;
  client.close();
  const gzipped = new grpc.Client(`127.0.0.1:${port}`, grpc.credentials.createInsecure(),
    { ...options, 'grpc.default_compression_algorithm': 2 });
  const text = Buffer.from('squeeze me '.repeat(10000));
  out.gzip = (await call(gzipped, '/t.Test/Echo', text)).reply?.equals(text) ?? false;
  gzipped.close();
  console.log(JSON.stringify(out));
}

main().catch((err) => { console.error(err); process.exit(1); });
