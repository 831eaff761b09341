// Type-checks a Grafana dashboard JSON against Grafana's own dashboard schema types
// (@grafana/schema, generated from Grafana's CUE kinds): unknown fields and wrong types fail.
// usage: node check_dashboard.mjs path/to/dashboard.json
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import ts from 'typescript';

const here = path.dirname(fileURLToPath(import.meta.url));
const json = fs.readFileSync(process.argv[2], 'utf8');
const file = path.join(here, '.dashboard-check.ts');
fs.writeFileSync(file, `import type { Dashboard } from '@grafana/schema';\nexport const dashboard: Dashboard = ${json};\n`);
const program = ts.createProgram([file], {
  noEmit: true, strict: true, skipLibCheck: true, target: ts.ScriptTarget.ES2022,
  module: ts.ModuleKind.ESNext, moduleResolution: ts.ModuleResolutionKind.Bundler,
});
const diagnostics = ts.getPreEmitDiagnostics(program);
fs.unlinkSync(file);
for (const d of diagnostics) {
  console.error(ts.flattenDiagnosticMessageText(d.messageText, '\n'));
}
console.log(diagnostics.length ? `dashboard schema: ${diagnostics.length} error(s)` : 'dashboard schema: ok');
process.exit(diagnostics.length ? 1 : 0);
