// The core E2B flow with the stock npm SDK; prints one JSON line with what it saw.
import { Sandbox, CommandExitError } from 'e2b'

const out = {}
const sbx = await Sandbox.create('base', { timeoutMs: 120_000, metadata: { suite: 'js' }, envs: { FROM_JS: 'yes' } })
try {
  out.id = sbx.sandboxId
  const info = await sbx.getInfo()
  out.state = info.state
  out.metadata = info.metadata
  const r = await sbx.commands.run('echo $FROM_JS; echo e >&2; whoami')
  out.stdout = r.stdout
  out.stderr = r.stderr
  try {
    await sbx.commands.run('exit 7')
  } catch (e) {
    out.exitError = e instanceof CommandExitError ? e.exitCode : String(e)
  }
  await sbx.files.write('js/hello.txt', 'hello from js')
  out.read = await sbx.files.read('js/hello.txt')
  out.list = (await sbx.files.list('js')).map((e) => e.name)
  out.exists = await sbx.files.exists('js/hello.txt')
  const listed = await Sandbox.list({ query: { metadata: { suite: 'js' } } }).nextItems()
  out.listed = listed.map((s) => s.sandboxId).includes(sbx.sandboxId)
} finally {
  out.killed = await sbx.kill()
}
console.log(JSON.stringify(out))
