{{/* Pieces of the pod that runs `pagedserve serve`: the single-node server, or the KubeRay head. */}}

{{- define "pagedserve.modelDir" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "image" -}}{{ $m.path }}
{{- else if eq $m.source "pvc" -}}{{ trimSuffix "/" (printf "%s/%s" $m.mountPath (trimPrefix "/" $m.path)) }}
{{- end -}}
{{- end -}}

{{/* The arguments after the entrypoint `pagedserve`, one list item each. */}}
{{- define "pagedserve.serveArgs" -}}
{{- $v := .Values -}}
{{- $e := $v.engine -}}
- --log-level={{ $v.server.logLevel }}
- serve
{{ include "pagedserve.portArgs" . }}
{{- with include "pagedserve.modelDir" . }}
- --model={{ . }}
{{- end }}
{{- with $v.model.servedModelName }}
- --served-model-name={{ . }}
{{- end }}
- --device={{ include "pagedserve.device" . }}
{{- if ne $e.dtype "auto" }}
- --dtype={{ $e.dtype }}
{{- end }}
- --tensor-parallel-size={{ $e.tensorParallelSize }}
{{- if gt (int (include "pagedserve.replicas" .)) (int $e.dataParallelSize) }}
- --prefill-replicas={{ $e.prefillReplicas }}
- --decode-replicas={{ $e.decodeReplicas }}
{{- else }}
- --data-parallel-size={{ $e.dataParallelSize }}
{{- end }}
{{- with $e.maxLocalPrefillLength }}
- --max-local-prefill-length={{ . }}
{{- end }}
{{- with $e.kvLeaseTimeout }}
- --kv-lease-timeout={{ . }}
{{- end }}
{{- with $e.maxModelLen }}
- --max-model-len={{ . }}
{{- end }}
{{- with $e.maxNumSeqs }}
- --max-num-seqs={{ . }}
{{- end }}
{{- with $e.maxWaitingRequests }}
- --max-waiting-requests={{ . }}
{{- end }}
- --drain-timeout={{ $e.drainTimeout }}
{{- with $v.server.autoscale }}
- --autoscale={{ . | nospace }}
{{- end }}
{{- if $v.tls.enabled }}
- --ssl-certfile=/etc/pagedserve/tls/tls.crt
- --ssl-keyfile=/etc/pagedserve/tls/tls.key
{{- end }}
{{- if $v.apiKey.existingSecret }}
- --api-key-file=/etc/pagedserve/api-key/{{ $v.apiKey.secretKey }}
{{- end }}
{{- if $v.tenants.existingSecret }}
- --tenants-file=/etc/pagedserve/tenants/{{ $v.tenants.secretKey }}
{{- end }}
{{- range $e.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* Where the servers listen, as `vllm serve` names it: --port the HTTP API (0: none), --grpc-port the gRPC API. */}}
{{- define "pagedserve.portArgs" -}}
{{- $s := .Values.server -}}
- --host=0.0.0.0
- --port={{ if $s.httpApi.enabled }}{{ $s.httpApi.port }}{{ else }}0{{ end }}
- --grpc-port={{ $s.grpcPort }}
- --metrics-port={{ $s.metricsPort }}
{{- end -}}

{{/* The environment of every container: HOME and the kernel cache on their emptyDirs (whatever user the pod runs
   as), then values' env. */}}
{{- define "pagedserve.env" -}}
- name: HOME
  value: {{ .Values.scratch.home.mountPath | quote }}
- name: TORCH_EXTENSIONS_DIR
  value: {{ .Values.scratch.kernelCache.mountPath | quote }}
# Ray starts its workers (the engine and tensor-parallel actors: the server's main work) at niceness 15 otherwise.
- name: RAY_worker_niceness
  value: "0"
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "pagedserve.gatewayPorts" -}}
- name: grpc
  containerPort: {{ .Values.server.grpcPort }}
  protocol: TCP
{{- if .Values.server.httpApi.enabled }}
- name: http
  containerPort: {{ .Values.server.httpApi.port }}
  protocol: TCP
{{- end }}
- name: metrics
  containerPort: {{ .Values.server.metricsPort }}
  protocol: TCP
{{- end -}}

{{/* What every probe runs: the gRPC health check (natively or through the CLI under TLS), or GET /health. */}}
{{- define "pagedserve.probeAction" -}}
{{- $v := .Values -}}
{{- if eq $v.probes.handler "http" -}}
httpGet:
  path: /health
  port: http
  scheme: {{ if $v.tls.enabled }}HTTPS{{ else }}HTTP{{ end }}
{{- else if and $v.tls.enabled (eq $v.tls.probeMode "exec") -}}
exec:
  command:
    - env
    - GRPC_DEFAULT_SSL_ROOTS_FILE_PATH=/etc/pagedserve/tls/{{ $v.tls.caKey }}
    - pagedserve
    - health
    - --server=localhost:{{ $v.server.grpcPort }}
    - --tls
{{- else -}}
grpc:
  port: {{ $v.server.grpcPort }}
  {{- if $v.tls.enabled }}
  mode: TLS
  {{- end }}
{{- end -}}
{{- end -}}

{{- define "pagedserve.probes" -}}
{{- $action := include "pagedserve.probeAction" . -}}
{{- range $name, $probe := dict "startupProbe" .Values.probes.startup "readinessProbe" .Values.probes.readiness "livenessProbe" .Values.probes.liveness }}
{{ $name }}:
  {{- $action | nindent 2 }}
  {{- toYaml $probe | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The emptyDirs of values' scratch: name, mountPath and sizeLimit of each. */}}
{{- define "pagedserve.scratchDirs" -}}
{{- $s := .Values.scratch -}}
{{- $dirs := list (dict "name" "tmp" "mountPath" $s.tmp.mountPath "sizeLimit" $s.tmp.sizeLimit)
                  (dict "name" "home" "mountPath" $s.home.mountPath "sizeLimit" $s.home.sizeLimit)
                  (dict "name" "kernel-cache" "mountPath" $s.kernelCache.mountPath "sizeLimit" $s.kernelCache.sizeLimit) -}}
{{- toYaml (dict "dirs" (concat $dirs (default list $s.extra))) -}}
{{- end -}}

{{/* Volumes of a pod; pass (dict "ctx" $ "gateway" true|false). */}}
{{- define "pagedserve.volumes" -}}
{{- $v := .ctx.Values -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $v.shm.sizeLimit }}
# Where the processes write (values' scratch): the root filesystem is read-only (securityContext).
{{- range (include "pagedserve.scratchDirs" .ctx | fromYaml).dirs }}
- name: {{ .name }}
  {{- if .sizeLimit }}
  emptyDir:
    sizeLimit: {{ .sizeLimit }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}
{{- if eq $v.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $v.model.pvc.claimName }}
    readOnly: true
{{- end }}
{{- if and .gateway $v.tls.enabled }}
- name: tls
  secret:
    secretName: {{ $v.tls.existingSecret }}
{{- end }}
{{- if and .gateway $v.apiKey.existingSecret }}
# The key as a file (--api-key-file), not an environment variable every process in the pod would inherit.
- name: api-key
  secret:
    secretName: {{ $v.apiKey.existingSecret }}
    defaultMode: 0440
{{- end }}
{{- if and .gateway $v.tenants.existingSecret }}
# The tenants' keys as a file (--tenants-file), as the API key.
- name: tenants
  secret:
    secretName: {{ $v.tenants.existingSecret }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "pagedserve.volumeMounts" -}}
{{- $v := .ctx.Values -}}
- name: dshm
  mountPath: /dev/shm
{{- range (include "pagedserve.scratchDirs" .ctx | fromYaml).dirs }}
- name: {{ .name }}
  mountPath: {{ .mountPath }}
{{- end }}
{{- if eq $v.model.source "pvc" }}
- name: model
  mountPath: {{ $v.model.mountPath }}
  readOnly: true
{{- end }}
{{- if and .gateway $v.tls.enabled }}
- name: tls
  mountPath: /etc/pagedserve/tls
  readOnly: true
{{- end }}
{{- if and .gateway $v.apiKey.existingSecret }}
- name: api-key
  mountPath: /etc/pagedserve/api-key
  readOnly: true
{{- end }}
{{- if and .gateway $v.tenants.existingSecret }}
- name: tenants
  mountPath: /etc/pagedserve/tenants
  readOnly: true
{{- end }}
{{- end -}}

{{/* Scheduling and security fields shared by every pod; pass (dict "ctx" $ "group" <values with nodeSelector, tolerations, affinity>). */}}
{{- define "pagedserve.podSpecCommon" -}}
{{- $v := .ctx.Values -}}
automountServiceAccountToken: false
terminationGracePeriodSeconds: {{ include "pagedserve.terminationGracePeriodSeconds" .ctx }}
{{- with $v.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $v.podSecurityContext | nindent 2 }}
{{- with .group.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* resources with the GPU limit added; pass (dict "resources" <map> "gpus" N "ctx" $). */}}
{{- define "pagedserve.resources" -}}
{{- $res := deepCopy (default dict .resources) -}}
{{- if and .ctx.Values.gpu.enabled (gt (int .gpus) 0) -}}
{{- $limits := default dict $res.limits -}}
{{- $_ := set $limits .ctx.Values.gpu.resourceName (int .gpus) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}
