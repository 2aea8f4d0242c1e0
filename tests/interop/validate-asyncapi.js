// Validates an AsyncAPI document with @asyncapi/parser, the parser behind the AsyncAPI CLI,
// generator and Studio: prints every diagnostic, and exits 1 if the document does not parse
// or any diagnostic is an error.
//
//   node validate-asyncapi.js <file>
const fs = require('fs');
const { Parser } = require('@asyncapi/parser');

const SEVERITY = ['error', 'warning', 'information', 'hint'];

async function main() {
  const text = fs.readFileSync(process.argv[2], 'utf8');
  const { document, diagnostics } = await new Parser().parse(text);
  for (const d of diagnostics) {
    console.log(`${SEVERITY[d.severity] ?? d.severity}: ${d.code}: ${d.message} at /${(d.path ?? []).join('/')}`);
  }
  const errors = diagnostics.filter((d) => d.severity === 0).length;
  if (!document || errors > 0) {
    console.log(`invalid: ${errors} errors`);
    process.exit(1);
  }
  console.log(`valid AsyncAPI ${document.version()}: ${document.channels().length} channels, ${document.operations().length} operations`);
}

main().catch((e) => {
  console.error(e);
  process.exit(2);
});
