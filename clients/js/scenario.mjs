// Subscribes to the subjects given and prints each message the application gets as a JSON line,
// until COUNT messages arrived: tests/test_js_client.py runs the same scenario with the Python client.
import { MigratoryClient } from "./migratory.js";

const [url, count, ...subjects] = process.argv.slice(2);
const client = new MigratoryClient([url]);
let seen = 0;
client.onMessage = (m) => {
  console.log(JSON.stringify({ subject: m.subject, content: m.text, fields: m.fields, type: m.type, seq: m.seq }));
  seen += 1;
  if (seen >= Number(count)) {
    client.close();
    process.exit(0);
  }
};
await client.connect();
await client.subscribe(subjects);
console.log(JSON.stringify({ ready: true }));
setTimeout(() => process.exit(3), 30000);
