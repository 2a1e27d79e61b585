{{/*
The pod every replica runs (and, for replicas spanning nodes, every LeaderWorkerSet member runs).
Call with (dict "root" $ "role" "single|leader|worker").
*/}}
{{- define "specdec.podSpec" -}}
{{- $ := .root -}}
{{- $role := .role -}}
{{- $v := $.Values -}}
{{- $gpu := eq (include "specdec.gpuBackend" $) "true" -}}
{{- $gpus := int (include "specdec.gpusPerPod" $) -}}
{{- $multi := eq (include "specdec.multiNode" $) "true" -}}
{{- $paths := include "specdec.healthPaths" $ | fromJson -}}
{{- $engine := include "specdec.enginePath" $ -}}
{{- $build := eq $v.engine.source "build" -}}
{{- $builder := and $build (ne $role "worker") -}}{{- /* one builder per replica group: the leader; workers wait */ -}}
{{- $modelRoot := ternary (printf "/models/%s" $v.model.pvc.target) "/models/target" (eq $v.model.source "pvc") -}}
{{- $draftRoot := ternary (printf "/models/%s" $v.model.pvc.draft) "/models/draft" (eq $v.model.source "pvc") -}}
serviceAccountName: {{ include "specdec.serviceAccountName" $ }}
terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
{{- with $v.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- if $v.runtimeClassName }}
runtimeClassName: {{ $v.runtimeClassName }}
{{- end }}
securityContext: {{- toYaml $v.podSecurityContext | nindent 2 }}
{{- $selector := $v.nodeSelector }}
{{- if $gpu }}{{- $selector = merge (dict "nvidia.com/gpu.product" $v.gpu.product) $v.nodeSelector }}{{- end }}
{{- with $selector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- $tolerations := $v.tolerations }}
{{- if and $gpu $v.gpu.tolerate }}{{- $tolerations = append $v.tolerations (dict "key" $v.gpu.resourceName "operator" "Exists" "effect" "NoSchedule") }}{{- end }}
{{- with $tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- if and $v.topologySpread.enabled (ne $role "worker") (or (gt (int $v.replicaCount) 1) $v.autoscaling.enabled) }}
topologySpreadConstraints:
  - maxSkew: 1
    topologyKey: {{ $v.topologySpread.topologyKey }}
    whenUnsatisfiable: {{ $v.topologySpread.whenUnsatisfiable }}
    labelSelector:
      matchLabels: {{- include "specdec.selectorLabels" $ | nindent 8 }}
{{- end }}
{{- if and $build (eq $role "worker") }}
initContainers:
  - name: wait-for-engine
    image: {{ include "specdec.image" $ }}
    imagePullPolicy: {{ $v.imagePullPolicy }}
    command: ["sh", "-c", "until [ -f \"$ENGINE/manifest.json\" ]; do echo \"waiting for the leader to build $ENGINE\"; sleep 10; done"]
    env:
      - {name: ENGINE, value: {{ $engine | quote }}}
    securityContext: {{- toYaml $v.securityContext | nindent 6 }}
    volumeMounts:
      - {name: engine-cache, mountPath: /engine-cache, readOnly: true}
{{- end }}
{{- if $builder }}
initContainers:
  {{- if eq $v.model.source "huggingface" }}
  - name: fetch-models
    image: {{ include "specdec.image" $ }}
    imagePullPolicy: {{ $v.imagePullPolicy }}
    command: ["python", "-c"]
    args:
      - |
        import os
        from huggingface_hub import snapshot_download
        for repo, where in ((os.environ["TARGET"], "/models/target"), (os.environ["DRAFT"], "/models/draft")):
            if not os.path.isfile(os.path.join(where, "config.json")):
                snapshot_download(repo, local_dir=where, token=os.environ.get("HF_TOKEN") or None)
    env:
      - {name: TARGET, value: {{ $v.model.huggingface.target | quote }}}
      - {name: DRAFT, value: {{ $v.model.huggingface.draft | quote }}}
      - {name: HOME, value: /tmp}
      {{- if $v.model.huggingface.tokenSecret.name }}
      - name: HF_TOKEN
        valueFrom: {secretKeyRef: {name: {{ $v.model.huggingface.tokenSecret.name }}, key: {{ $v.model.huggingface.tokenSecret.key }}}}
      {{- end }}
    securityContext: {{- toYaml $v.securityContext | nindent 6 }}
    volumeMounts:
      - {name: models, mountPath: /models}
      - {name: tmp, mountPath: /tmp}
  {{- else if eq $v.model.source "s3" }}
  - name: fetch-models
    image: {{ printf "%s:%s" $v.images.s3.repository $v.images.s3.tag }}
    imagePullPolicy: {{ $v.imagePullPolicy }}
    command: ["sh", "-c", "aws s3 sync \"$TARGET\" /models/target && aws s3 sync \"$DRAFT\" /models/draft"]
    env:
      - {name: TARGET, value: {{ $v.model.s3.target | quote }}}
      - {name: DRAFT, value: {{ $v.model.s3.draft | quote }}}
      - {name: HOME, value: /tmp}
    {{- with $v.model.s3.credentialsSecret }}
    envFrom:
      - secretRef: {name: {{ . }}}
    {{- end }}
    securityContext: {{- toYaml $v.securityContext | nindent 6 }}
    volumeMounts:
      - {name: models, mountPath: /models}
      - {name: tmp, mountPath: /tmp}
  {{- end }}
  - name: build-engine
    image: {{ include "specdec.image" $ }}
    imagePullPolicy: {{ $v.imagePullPolicy }}
    command: ["specdec-build-engine"]
    args:
      - --draft={{ $v.engine.draft }}
      - --target={{ $modelRoot }}
      - --draft-path={{ $draftRoot }}
      - --backend={{ ternary "onnxruntime" $v.backend (eq $v.backend "embedded") }}
      - --tp={{ $v.parallelism.tensor }}
      - --pp={{ $v.parallelism.pipeline }}
      - --tree={{ $v.engine.tree }}
      {{- if eq $v.engine.tree "dynamic" }}
      - --total-tokens={{ $v.engine.totalTokens }}
      - --depth={{ $v.engine.depth }}
      - --top-k={{ $v.engine.topK }}
      {{- end }}
      - --dtype={{ $v.engine.dtype }}
      - --output={{ $engine }}
      {{- range $v.engine.buildArgs }}
      - {{ . | quote }}
      {{- end }}
    env:
      - {name: HOME, value: /tmp}
    securityContext: {{- toYaml $v.securityContext | nindent 6 }}
    resources:
      {{- if $gpu }}
      requests: {{- toYaml (merge (dict $v.gpu.resourceName $gpus) $v.gpuResources.requests) | nindent 8 }}
      limits: {{- toYaml (merge (dict $v.gpu.resourceName $gpus) $v.gpuResources.limits) | nindent 8 }}
      {{- else }}
      {{- toYaml $v.resources | nindent 6 }}
      {{- end }}
    volumeMounts:
      - {name: models, mountPath: /models, readOnly: true}
      - {name: engine-cache, mountPath: /engine-cache}
      - {name: tmp, mountPath: /tmp}
{{- end }}
containers:
  - name: server
    image: {{ include "specdec.image" $ }}
    imagePullPolicy: {{ $v.imagePullPolicy }}
    command: ["specdec-serve"]
    args:
      - --engine={{ $engine }}
      - --host=0.0.0.0
      - --port={{ $v.server.port }}
      - --served-model-name={{ default (include "specdec.fullname" $) $v.server.servedModelName }}
      {{- if not $gpu }}
      - --max-num-seqs={{ $v.server.maxNumSeqs }}
      - --max-queue={{ $v.server.maxQueue }}
      - --speculation={{ $v.server.speculation }}
      - --drain-timeout={{ $v.server.drainTimeoutSeconds }}
      {{- end }}
      {{- if or $multi $v.server.extraArgs }}
      - "--"
      {{- end }}
      {{- if $multi }}
      - --nnodes={{ include "specdec.nodesPerReplica" $ }}
      - --node-rank=$(LWS_WORKER_INDEX)
      - --dist-init-addr=$(LWS_LEADER_ADDRESS):20000
      {{- end }}
      {{- range $v.server.extraArgs }}
      - {{ . | quote }}
      {{- end }}
    env:
      - {name: HOME, value: /tmp}
      {{- if $v.apiKey.existingSecret }}
      - name: SPECDEC_API_KEY
        valueFrom: {secretKeyRef: {name: {{ $v.apiKey.existingSecret }}, key: {{ $v.apiKey.key }}}}
      {{- end }}
      {{- with $v.server.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    ports:
      - {name: http, containerPort: {{ $v.server.port }}, protocol: TCP}
    {{- if ne $role "worker" }}
    startupProbe:
      httpGet: {path: {{ $paths.live }}, port: http}
      periodSeconds: {{ $v.probes.startup.periodSeconds }}
      failureThreshold: {{ $v.probes.startup.failureThreshold }}
    livenessProbe:
      httpGet: {path: {{ $paths.live }}, port: http}
      periodSeconds: {{ $v.probes.liveness.periodSeconds }}
      timeoutSeconds: {{ $v.probes.liveness.timeoutSeconds }}
      failureThreshold: {{ $v.probes.liveness.failureThreshold }}
    readinessProbe:
      httpGet: {path: {{ $paths.ready }}, port: http}
      periodSeconds: {{ $v.probes.readiness.periodSeconds }}
      timeoutSeconds: {{ $v.probes.readiness.timeoutSeconds }}
      failureThreshold: {{ $v.probes.readiness.failureThreshold }}
    {{- end }}
    lifecycle:
      preStop:
        exec: {command: ["sleep", "{{ $v.preStopSleepSeconds }}"]}
    securityContext: {{- toYaml $v.securityContext | nindent 6 }}
    resources:
      {{- if $gpu }}
      requests: {{- toYaml (merge (dict $v.gpu.resourceName $gpus) $v.gpuResources.requests) | nindent 8 }}
      limits: {{- toYaml (merge (dict $v.gpu.resourceName $gpus) $v.gpuResources.limits) | nindent 8 }}
      {{- else }}
      {{- toYaml $v.resources | nindent 6 }}
      {{- end }}
    volumeMounts:
      - {name: tmp, mountPath: /tmp}
      {{- if or $build (and (eq $v.engine.source "prebuilt") $v.engine.cache.existingClaim) }}
      - {name: engine-cache, mountPath: /engine-cache, readOnly: true}
      {{- end }}
      {{- if gt (int (include "specdec.gpusPerReplica" $)) 1 }}
      - {name: shm, mountPath: /dev/shm}
      {{- end }}
volumes:
  - name: tmp
    emptyDir: {}
  {{- if or $build (and (eq $v.engine.source "prebuilt") $v.engine.cache.existingClaim) }}
  - name: engine-cache
    persistentVolumeClaim: {claimName: {{ include "specdec.engineClaim" $ }}}
  {{- end }}
  {{- if $builder }}
  - name: models
    {{- if eq $v.model.source "pvc" }}
    persistentVolumeClaim: {claimName: {{ $v.model.pvc.claimName }}, readOnly: true}
    {{- else }}
    emptyDir: {sizeLimit: {{ $v.model.scratch.size }}}
    {{- end }}
  {{- end }}
  {{- if gt (int (include "specdec.gpusPerReplica" $)) 1 }}
  - name: shm
    emptyDir: {medium: Memory, sizeLimit: {{ $v.shm.sizeLimit }}}
  {{- end }}
{{- end -}}
