// Validates Prometheus Operator objects (PodMonitor, ServiceMonitor) against the JSON schemas
// generated from the operator's published CRDs (@kubernetes-models/prometheus-operator).
// usage: node check_crds.mjs file.yaml [...]
import fs from 'node:fs';
import { parseAllDocuments } from 'yaml';
import { PodMonitor, ServiceMonitor } from '@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1';

const kinds = { PodMonitor, ServiceMonitor };
let failures = 0;
let checked = 0;
for (const file of process.argv.slice(2)) {
  for (const doc of parseAllDocuments(fs.readFileSync(file, 'utf8'))) {
    const obj = doc.toJS();
    if (!obj || !(obj.kind in kinds) || obj.apiVersion !== 'monitoring.coreos.com/v1') continue;
    try {
      new kinds[obj.kind](obj).validate();
      checked += 1;
    } catch (err) {
      failures += 1;
      console.error(`${file}: ${obj.kind} ${obj.metadata?.name}: ${err.message}`);
    }
  }
}
console.log(`crds: ${checked} valid, ${failures} invalid`);
process.exit(failures || !checked ? 1 : 0);
